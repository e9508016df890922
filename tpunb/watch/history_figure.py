"""The figure of a launch's history (``History.plot()``): each logged value per core,
samples/s per core and in total, and the graphs compiled per training step, with the
epochs marked. matplotlib is imported only when it is drawn."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpunb.errors import TpunbError
from tpunb.plots import _figure_class

if TYPE_CHECKING:
    from typing import Any

    from matplotlib.figure import Figure

STEP = "training step (one batch on each core)"
SMOOTH_FROM = 20  # points in a line from which it is drawn smoothed over the raw one


def history_figure(
    # a tpunb.History: not imported here, History.plot() imports this module
    history: Any,
    width: float = 10.0,
    panel_height: float = 2.6,
    fixed_layout: bool = False,
) -> Figure:
    """A matplotlib Figure with one panel per logged value, one for throughput (when the
    loader's batches were recorded) and one for compilations per step. ``fixed_layout``
    sets margins instead of computing them: the figure draws in half the time (live
    frames)."""
    Figure = _figure_class()
    panels = [(name, _draw_values) for name in history.names()]
    if any(s.samples for steps in history.steps.values() for s in steps):
        panels.append(("samples/s", _draw_throughput))
    if history.compiles_per_step():
        panels.append(("compilations", _draw_compiles))
    if not panels:
        raise TpunbError(
            "Nothing to plot: the launch logged no values (tpunb.log(loss=loss) inside the "
            "launched function), read no batches through a torch_xla loader, and recorded "
            "no compilations."
        )
    # Figure, not pyplot: no global state, no GUI backend, and it renders in notebooks.
    height = panel_height * len(panels)
    figure = Figure(figsize=(width, height), layout=None if fixed_layout else "constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    if fixed_layout:  # inches: room for the legend, tick labels, titles, the twin axis
        figure.subplots_adjust(
            left=0.8 / width,
            right=1 - 0.8 / width,
            top=1 - 0.65 / height,
            bottom=0.5 / height,
            hspace=0.85 / (panel_height - 0.85),
        )
    from matplotlib.ticker import MaxNLocator

    epoch_starts = history.epoch_starts()
    for ax, (name, draw) in zip(axes, panels, strict=True):
        draw(ax, history, name)
        ax.grid(alpha=0.3)
        ax.set_xlim(left=-0.6)  # step 0's bar whole
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are counted
        _mark_epochs(ax, epoch_starts)
    _core_legend(figure, history.ranks, "upper center" if fixed_layout else "outside upper center")
    return figure


def _core_legend(figure, ranks, where):
    """One legend for the whole figure, above the panels: the cores' colours."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color, lw=2) for color in _core_colors(ranks)]
    labels = [f"core {rank}" for rank in range(ranks)]
    figure.legend(handles, labels, loc=where, ncol=min(8, ranks), frameon=False)


def _core_colors(ranks):
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(rank % 10) for rank in range(ranks)]


def _mark_epochs(ax, starts):
    """A dashed line where each epoch after the first begins, named at the top."""
    if not starts:
        return
    label_every = -(-len(starts) // 12)  # at most about 12 names, however many epochs
    for number, start in enumerate(starts, start=2):
        ax.axvline(start + 0.5, color="gray", lw=0.8, ls="--", alpha=0.6)
        if (number - 2) % label_every == 0:
            ax.annotate(
                f"epoch {number}",
                (start + 0.5, 1),
                xycoords=("data", "axes fraction"),
                xytext=(2, -2),
                textcoords="offset points",
                va="top",
                fontsize=7,
                color="gray",
            )


def _smoothed(values):
    """A moving average centred on each point, over about a tenth of the line (at least 3
    points; fewer at the ends): it follows the trend without lagging behind it."""
    half = max(1, round(len(values) / 20))
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    out = []
    for i in range(len(values)):
        low, high = max(0, i - half), min(len(values), i + half + 1)
        out.append((sums[high] - sums[low]) / (high - low))
    return out


def _draw_values(ax, history, name):
    colors = _core_colors(history.ranks)
    lines = history.values(name)
    first = next(iter(lines.values()))
    if len(lines) > 1 and all(line == first for line in lines.values()):
        # The same on every core (e.g. a learning rate): one line, said to be all of them.
        ax.plot(*first, color="black", lw=1.4, label="every core (equal)")
        ax.legend(loc="best", fontsize=8, frameon=False)
        ax.set(title=f"{name} (the same on every core)", xlabel=STEP, ylabel=name)
        return
    for rank, (steps, values) in lines.items():
        if len(values) >= SMOOTH_FROM:  # raw values faint, their trend drawn over them
            ax.plot(steps, values, color=colors[rank], lw=0.6, alpha=0.25)
            values = _smoothed(values)
        ax.plot(steps, values, color=colors[rank], lw=1.4, alpha=0.85, label=f"core {rank}")
    faint = " (faint: each step; bold: smoothed)" if len(first[1]) >= SMOOTH_FROM else ""
    ax.set(title=f"{name} per core{faint}", xlabel=STEP, ylabel=name)


def _draw_throughput(ax, history, _name):
    """Each core's rate on the left axis, where the cores' lines can be told apart; all the
    cores' on the right, scaled by the core count so that it lies on the cores' mean."""
    colors = _core_colors(history.ranks)
    top = 0.0
    for rank in range(history.ranks):
        steps, rates = history.samples_per_second(rank)
        ax.plot(steps, rates, color=colors[rank], lw=1.0, alpha=0.8)
        top = max([top, *rates])
    ax.set(
        title=f"samples/s, each the mean of the last {history.rate_over} steps "
        "(colours: each core, left; black: all cores, right)",
        xlabel=STEP,
        ylabel="samples/s per core",
        ylim=(0, top * 1.1 or 1),
    )
    total = ax.twinx()
    total.plot(*history.samples_per_second(), color="black", lw=1.4, alpha=0.7)
    total.set_ylim(0, (top * 1.1 or 1) * history.ranks)
    total.set_ylabel("samples/s, all cores")


def _draw_compiles(ax, history, _name):
    per_step = history.compiles_per_step()
    steps = [at.step for at in per_step]
    width = max(0.8, steps[-1] / 150)  # visible however many steps
    warmup, later, helper = [], [], []
    for at in per_step:  # as the compile watch judged each step
        own = at.compiles - at.warmup - at.not_training  # a training step's own, later
        if at.warmup:
            warmup.append((at.step, at.warmup, 0))
        if own:
            later.append((at.step, own, at.warmup))
        if at.not_training:  # stacked on the step's own
            helper.append((at.step, at.not_training, at.warmup + own))
    for bars, color, label in (
        (warmup, "tab:gray", "warm-up: the first steps compile the graphs"),
        (later, "tab:red", "later: a graph not seen before (new shape?)"),
        (helper, "tab:cyan", "not a training step: rendezvous, Lightning's work, after the loop"),
    ):
        if bars:  # one bar a step that compiled: a few patches, however long the run
            x, n, bottom = zip(*bars, strict=True)
            ax.bar(x, n, bottom=bottom, color=color, width=width, label=label)
    compiled = [at for at in per_step if at.compiles]
    if len(compiled) <= 30:  # each step's count over its bar (its parts would overlap)
        for at in compiled:
            ax.annotate(
                str(at.compiles),
                (at.step, at.compiles),
                xytext=(0, 1),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set(title="graphs compiled per training step (per process)", xlabel=STEP, ylabel="graphs")
    ax.margins(y=0.2)
    twin = ax.twinx()
    total = 0.0
    cumulative = []
    for at in per_step:
        total += at.seconds
        cumulative.append(total)
    twin.plot(steps, cumulative, color="black", lw=1, alpha=0.6, label="compile seconds so far")
    twin.set_ylabel("compile seconds, total")
    twin.set_ylim(bottom=0)
    handles = [h for a in (ax, twin) for h in a.get_legend_handles_labels()[0]]
    ax.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
