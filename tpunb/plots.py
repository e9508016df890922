"""Figures of a launch's history: each logged value per core, samples/s per core and in
total, and compilations per step. matplotlib is imported only when a figure is drawn."""

from tpunb.errors import TpunbError


def history_figure(history, width=10.0, panel_height=2.6):
    """A matplotlib Figure with one panel per logged value, one for throughput (when the
    loader's batches were recorded) and one for compilations per step."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TpunbError(
            "Plotting needs matplotlib: pip install 'tpunb[plots]' (or pip install matplotlib)."
        ) from None
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
    figure = Figure(figsize=(width, panel_height * len(panels)), layout="constrained")
    axes = figure.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (name, draw) in zip(axes, panels, strict=True):
        draw(ax, history, name)
        ax.grid(alpha=0.3)
    return figure


def _core_colors(ranks):
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return [palette(rank % 10) for rank in range(ranks)]


def _draw_values(ax, history, name):
    colors = _core_colors(history.ranks)
    for rank, (steps, values) in history.values(name).items():
        ax.plot(steps, values, color=colors[rank], lw=1.2, label=f"core {rank}")
    ax.set(title=f"{name} per core", xlabel="step", ylabel=name)
    ax.legend(ncol=min(8, history.ranks), fontsize="small", loc="upper right")


def _draw_throughput(ax, history, _name):
    colors = _core_colors(history.ranks)
    for rank in range(history.ranks):
        ax.plot(*history.samples_per_second(rank), color=colors[rank], lw=0.8, alpha=0.6)
    ax.plot(*history.samples_per_second(), color="black", lw=1.6, label="all cores")
    ax.legend(fontsize="small", loc="upper right")
    ax.set(
        title="samples/s (thin: each core; black: all cores)", xlabel="seconds", ylabel="samples/s"
    )


def _draw_compiles(ax, history, _name):
    steps, counts, seconds = zip(*history.compiles_per_step(), strict=True)
    ax.bar(steps, counts, color="tab:red", width=0.8)
    ax.set(title="new compilations per step (all processes)", xlabel="step", ylabel="graphs")
    twin = ax.twinx()
    total = 0.0
    cumulative = []
    for s in seconds:
        total += s
        cumulative.append(total)
    twin.plot(steps, cumulative, color="tab:gray", lw=1.2)
    twin.set_ylabel("compile seconds, cumulative")
