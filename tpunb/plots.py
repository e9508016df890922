"""The lessons' small figures, each one call (lines, bars, the samples each core saw, launch
layouts), and what every figure of tpunb shares: matplotlib's Figure without pyplot, shown
in notebooks. matplotlib is imported only when a figure is drawn. The figure of a launch's
history is ``history_figure.py``'s."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tpunb import machine
from tpunb.errors import TpunbError
from tpunb.upstream import versions

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.figure import Figure

DPI = 90  # figures shown in a notebook


def lines(
    series: dict[str, Sequence[float] | tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str | None = None,
    size: tuple[float, float] = (8, 3.2),
    x: Sequence[float] | None = None,
    log_x: bool = False,
) -> Figure:
    """One line per entry of ``series`` (label -> values, or label -> (x values, values)),
    labelled, at ``x`` (1, 2, ... by default); ``log_x``: a logarithmic x axis ticked at
    ``x``.

    Args:
        series: label -> values, or label -> (x values, values).
        xlabel: the x axis's label (what a learner counts: steps, epochs).
        ylabel: the y axis's label, with its unit.
        title: above the figure, or None.
        size: inches, width and height.
        x: the x values of every series, or None (1, 2, ...).
        log_x: a logarithmic x axis.

    Returns:
        A matplotlib ``Figure``, drawn when a notebook displays it."""
    figure, ax = _figure(size)
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    for (label, values), (marker, line) in zip(series.items(), itertools.cycle(styles)):
        at = x if x is not None else range(1, len(values) + 1)
        if isinstance(values, tuple):
            at, values = values
        # Marker and line style differ too: lines that lie on each other stay visible.
        every = max(1, len(values) // 15)  # at most about 15 markers a line
        ax.plot(at, values, marker=marker, markevery=every, ls=line, label=label)
    if log_x:
        ax.set_xscale("log")
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
    elif x is None:  # counts (epochs, steps): whole numbers only
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    return shown_in_notebooks(figure)


def samples_seen(
    panels: dict[str, Sequence[Sequence[int]]],
    first: int = 96,
    size: tuple[float, float] | None = None,
) -> Figure:
    """Which samples each core trained on: a panel per entry of ``panels`` (title -> the
    sample indices of each core, by rank), a row per core, a square per sample of the
    ``first`` indices.

    Args:
        panels: title -> the sample indices each core trained on, by rank.
        first: how many of the first indices to draw.
        size: inches, width and height, or None (from the panels).

    Returns:
        A matplotlib ``Figure``, drawn when a notebook displays it."""
    size = size or (9, 0.5 + 2.1 * len(panels))
    figure = _figure_class()(figsize=size, layout="constrained")
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, per_core) in zip(axes, panels.items(), strict=True):
        for rank, indices in enumerate(per_core):
            shown = [i for i in indices if i < first]
            ax.scatter(shown, [rank] * len(shown), s=40, marker="s")
        ax.set(title=title, ylabel="core", yticks=range(len(per_core)))
    axes[-1].set_xlabel(f"sample index (the first {first} samples)")
    return shown_in_notebooks(figure)


def bars(
    values: dict[str, float],
    xlabel: str,
    title: str | None = None,
    size: tuple[float, float] = (8, 3.2),
    marks: dict[str, float] | None = None,
    log: bool = False,
) -> Figure:
    """Horizontal bars, one per entry of ``values`` (label -> number), top to bottom, each
    with its number written beside it; ``marks`` (label -> number): dashed vertical lines
    to compare the bars with, named in a legend; ``log``: a logarithmic axis.

    Args:
        values: label -> number, a bar each.
        xlabel: the axis's label, with its unit.
        title: above the figure, or None.
        size: inches, width and height.
        marks: label -> number, a dashed line each, or None.
        log: a logarithmic axis.

    Returns:
        A matplotlib ``Figure``, drawn when a notebook displays it."""
    figure, ax = _figure(size)
    labels = list(values)[::-1]
    drawn = ax.barh(labels, [values[label] for label in labels], color="tab:blue")
    ax.bar_label(drawn, fmt="%.3g", padding=3)
    colors = ("tab:red", "tab:orange", "tab:green")
    for (label, x), color in zip((marks or {}).items(), colors, strict=False):
        ax.axvline(x, color=color, ls="--", lw=1.2, label=label)
    if marks:
        ax.legend(loc="upper right", fontsize=8)
    ax.set(xlabel=xlabel, title=title)
    if log:
        ax.set_xscale("log")
    ax.margins(x=0.15)
    return shown_in_notebooks(figure)


def launch_layouts(
    layouts: dict[str, tuple[int, int]], size: tuple[float, float] = (11, 4.2)
) -> Figure:
    """How ``xmp.spawn`` lays ranks out: a row per entry of ``layouts`` (label ->
    (processes, ranks per process)), each process a box, each rank a numbered dot.

    Args:
        layouts: label -> (processes, ranks per process).
        size: inches, width and height.

    Returns:
        A matplotlib ``Figure``, drawn when a notebook displays it."""
    from matplotlib.patches import Circle, FancyBboxPatch

    figure, ax = _figure(size)
    for row, (name, (processes, per_process)) in enumerate(layouts.items()):
        y = -row
        for p in range(processes):
            first = p * per_process
            x0 = first + p * 0.3  # a gap between processes
            box = FancyBboxPatch(
                (x0 - 0.45, y - 0.38),
                per_process - 0.1,
                0.76,
                boxstyle="round,pad=0.02",
                facecolor="#e8eef7",
                edgecolor="#4c72b0",
            )
            ax.add_patch(box)
            for t in range(per_process):
                ax.add_patch(Circle((x0 + t, y), 0.28, color="#dd8452"))
                ax.text(x0 + t, y, str(first + t), ha="center", va="center", color="white")
        ranks = processes * per_process
        label = (
            f"{name}\n{_count(processes, 'process', 'processes')} x "
            f"{_count(per_process, 'thread', 'threads')} = {_count(ranks, 'rank', 'ranks')}"
        )
        ax.text(-0.8, y, label, ha="right", va="center")
    widest = max(p * t + 0.3 * (p - 1) for p, t in layouts.values())
    ax.set_xlim(-5, widest + 0.3)
    ax.set_ylim(-len(layouts) + 0.5, 0.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("One process per chip (blue box), one rank per device (numbered dot)")
    return shown_in_notebooks(figure)


def _count(n, one, many):
    return f"{n} {one if n == 1 else many}"


def _figure(size):
    figure = _figure_class()(figsize=size, layout="constrained")
    return figure, figure.subplots()


def _figure_class():
    """matplotlib's Figure (not pyplot: no global state, no GUI backend)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TpunbError(
            "Plotting needs matplotlib: pip install matplotlib (or "
            f'pip install "{versions.requirement("plots")}").'
        ) from None
    return Figure


def shown_in_notebooks(figure: Figure) -> Figure:
    """``figure``, drawn as an image when a notebook displays it. IPython draws
    matplotlib figures only once pyplot set up its inline backend; tpunb never imports
    pyplot (global state), so it registers the drawing for Figure itself.

    Args:
        figure: a matplotlib ``Figure``.

    Returns:
        ``figure`` itself."""
    if machine.in_kernel():
        from IPython import get_ipython
        from IPython.core.pylabtools import print_figure
        from matplotlib.figure import Figure

        formatter = get_ipython().display_formatter.formatters["image/png"]
        try:
            formatter.lookup_by_type(Figure)  # pyplot's inline backend already draws them
        except KeyError:
            formatter.for_type(Figure, lambda shown: print_figure(shown, "png", dpi=DPI))
    return figure
