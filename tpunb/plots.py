"""Figures of a launch's history: each logged value per core, samples/s per core and in
total, and compilations per step; and the lessons' small figures, each one call. matplotlib
is imported only when a figure is drawn."""

from tpunb import platform, versions
from tpunb.errors import TpunbError

STEP = "step (one a torch_xla.sync, epoch ends included)"
DPI = 90  # figures shown in a notebook


def history_figure(history, width=10.0, panel_height=2.6, fixed_layout=False):
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
    for ax, (name, draw) in zip(axes, panels, strict=True):
        draw(ax, history, name)
        ax.grid(alpha=0.3)
    _core_legend(figure, history.ranks, "upper center" if fixed_layout else "outside upper center")
    return figure


def lines(series, xlabel, ylabel, title=None, size=(8, 3.2)):
    """One line per entry of ``series`` (label -> values at x = 1, 2, ...), labelled."""
    figure, ax = _figure(size)
    for label, values in series.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    return shown_in_notebooks(figure)


def bars(values, xlabel, title=None, size=(8, 3.2)):
    """Horizontal bars, one per entry of ``values`` (label -> number), top to bottom, each
    with its number written beside it."""
    figure, ax = _figure(size)
    labels = list(values)[::-1]
    drawn = ax.barh(labels, [values[label] for label in labels], color="tab:blue")
    ax.bar_label(drawn, fmt="%.3g", padding=3)
    ax.set(xlabel=xlabel, title=title)
    ax.margins(x=0.15)
    return shown_in_notebooks(figure)


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


def shown_in_notebooks(figure):
    """``figure``, drawn as an image when a notebook displays it. IPython draws
    matplotlib figures only once pyplot set up its inline backend; tpunb never imports
    pyplot (global state), so it registers the drawing for Figure itself."""
    if platform.in_kernel():
        from IPython import get_ipython
        from IPython.core.pylabtools import print_figure
        from matplotlib.figure import Figure

        formatter = get_ipython().display_formatter.formatters["image/png"]
        try:
            formatter.lookup_by_type(Figure)  # pyplot's inline backend already draws them
        except KeyError:
            formatter.for_type(Figure, lambda shown: print_figure(shown, "png", dpi=DPI))
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


def _draw_values(ax, history, name):
    colors = _core_colors(history.ranks)
    for rank, (steps, values) in history.values(name).items():
        ax.plot(steps, values, color=colors[rank], lw=1.2, label=f"core {rank}")
    ax.set(title=f"{name} per core", xlabel=STEP, ylabel=name)


def _draw_throughput(ax, history, _name):
    colors = _core_colors(history.ranks)
    for rank in range(history.ranks):
        ax.plot(*history.samples_per_second(rank), color=colors[rank], lw=0.8, alpha=0.7)
    ax.plot(*history.samples_per_second(), color="black", lw=1.6, label="all cores")
    ax.set(
        title="samples/s (thin: each core; black: all cores)",
        xlabel=STEP,
        ylabel="samples/s",
        ylim=(0, None),
    )


def _draw_compiles(ax, history, _name):
    steps, counts, seconds = zip(*history.compiles_per_step(), strict=True)
    compiled = [(step, count) for step, count in zip(steps, counts, strict=True) if count]
    if compiled:  # one bar a step that compiled: a few patches, however long the run
        width = max(0.8, steps[-1] / 150)  # visible however many steps
        ax.bar(*zip(*compiled, strict=True), color="tab:red", width=width)
    ax.set(title="new compilations per step (all processes)", xlabel=STEP, ylabel="graphs")
    twin = ax.twinx()
    total = 0.0
    cumulative = []
    for s in seconds:
        total += s
        cumulative.append(total)
    twin.plot(steps, cumulative, color="tab:gray", lw=1.2)
    twin.set_ylabel("compile seconds, cumulative")
