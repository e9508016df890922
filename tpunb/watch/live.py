"""What the notebook shows while a launch runs, drawn in the kernel's main thread: forked
ranks cannot display (the kernel drops their display messages) and Colab drops widget
updates from other threads (https://github.com/googlecolab/colabtools/issues/3373).

Where a front end draws widgets, a progress line (``Snapshot``: step, epoch, samples/s,
ETA, compilations, from the tails of the history only) and a figure of the history so
far, redrawn at a bounded rate; elsewhere (nbval, nbclient, a console, a script) a text
line each epoch. Both end with the final
figure, kept in the notebook as a plain image."""

import dataclasses
import importlib.util
import io
import time

from tpunb import machine, plots
from tpunb.errors import TpunbError, warn
from tpunb.upstream import versions
from tpunb.watch.history import RATE_OVER

MODES = ("auto", "widgets", "text", "off")
PROGRESS_SECONDS = 0.5  # widgets: the progress line is redrawn at most this often
FIGURE_SECONDS = 1.0  # widgets: the figure is redrawn at most this often, and less often
FIGURE_SHARE = 0.05  # when drawing it would take more than this share of the time
TEXT_SECONDS = 60  # text: a line at each epoch's end, and after this long without one
NO_WIDGETS = (
    "The live view needs the Jupyter widgets extension in this front end (pip install "
    "ipywidgets where Jupyter runs, or launch(..., live='text')); the figure follows at the end."
)
LIVE_DPI = 72  # live frames; the final figure has plots.DPI


def resolve(live):
    """The view a launch shows for ``launch(live=...)``: "widgets", "text" or "off".
    Checked before the fork."""
    if live is True:
        live = "auto"
    elif live is False or live is None:
        return "off"
    if live not in MODES:
        raise TpunbError(
            f"launch(live={live!r}): give one of {', '.join(map(repr, MODES))} "
            "(or True/False). 'auto' shows a live figure where the notebook draws widgets "
            "and a text line each epoch elsewhere."
        )
    missing = [m for m in ("ipywidgets", "matplotlib") if importlib.util.find_spec(m) is None]
    if live == "widgets":
        if missing:
            raise TpunbError(
                f"launch(live='widgets') needs {' and '.join(missing)}: pip install "
                f'{" ".join(missing)} (or "{versions.requirement("plots")}"), then restart the '
                "kernel."
            )
        if not machine.in_kernel():
            raise TpunbError(
                "launch(live='widgets') draws in a Jupyter notebook, and this Python is not "
                "a notebook kernel. Use live='text' (a line each epoch) or live=False."
            )
    if live == "auto":
        live = "widgets" if machine.draws_widgets() and not missing else "text"
    return live


def view(mode, history, watch, clock=time.monotonic):
    """The view for ``mode`` (from ``resolve``), following ``history`` and ``watch``."""
    return {"widgets": WidgetView, "text": TextView, "off": _View}[mode](history, watch, clock)


class _View:
    """No view (``live=False``): records nothing beyond the history."""

    def __init__(self, history, watch, clock):
        self.history = history
        self.watch = watch
        self.clock = clock
        self.start = clock()
        self.figures = 0  # figures drawn, live and final

    def update(self):
        """Called by the launch's watch loop, many times a second."""

    def close(self, failed):
        """The launch ended (``failed``: with an error about to be raised)."""

    def snapshot(self):
        return Snapshot.of(self.history, self.watch.compiles, self.clock() - self.start)

    def _figure(self, live=False):
        """The history's figure as PNG bytes, or None when there is nothing to plot. A
        live frame is drawn faster: fixed margins, lower resolution, light compression."""
        if not any(self.history.steps.values()):
            return None
        try:
            figure = self.history.plot(fixed_layout=live)
        except TpunbError:  # nothing logged, no batches, no compilations
            return None
        buffer = io.BytesIO()
        compression = {"compress_level": 1} if live else {}
        figure.savefig(
            buffer, format="png", dpi=LIVE_DPI if live else plots.DPI, pil_kwargs=compression
        )
        self.figures += 1
        return buffer.getvalue()

    @staticmethod
    def _show_final_figure(png):
        """Shows the PNG as a plain image output, which the saved notebook keeps."""
        if png is not None:
            from IPython.display import Image, display

            display(Image(data=png, format="png"))


class TextView(_View):
    """A line each epoch (and at least every ``TEXT_SECONDS``), a last line, and in a
    kernel the final figure."""

    def __init__(self, history, watch, clock):
        super().__init__(history, watch, clock)
        self._epoch = None  # the epoch the last line was about
        self._last_line = self.start

    def update(self, heard_from_only=False):
        # An epoch's line waits for every rank to pass it (its values are their mean),
        # unless the launch ended: then the ranks heard from.
        runs = [s for s in self.history.steps.values() if s or not heard_from_only]
        slowest = min(runs, key=len, default=[])
        epoch = slowest[-1].epoch if slowest else None
        if epoch is not None and epoch != self._epoch:
            # Every epoch that ended since the last call (a flush can hold several).
            for ended in range(self._epoch or 0, epoch):
                self._print(self._epoch_end(ended))
            self._epoch = epoch
        if self.clock() - self._last_line >= TEXT_SECONDS:
            self._print(", ".join(self.snapshot().parts()))

    def close(self, failed):
        self.update(heard_from_only=True)  # the epochs that ended since the last call
        if self._epoch is None and not self.history.names():
            return  # no loader read and nothing logged: no line to add to the rank's output
        snapshot = self.snapshot()
        if not failed and self._epoch is not None:
            self._print(self._epoch_end(self._epoch))
        state = "stopped" if failed else "done"
        print(f"{state}: {', '.join(snapshot.parts(final=True))}", flush=True)
        if machine.in_kernel():
            self._show_final_figure(self._figure())

    def _epoch_end(self, epoch):
        """The line for a finished epoch: the last value of each name on every rank."""
        in_epoch = [
            [s for s in reversed(steps) if s.epoch == epoch]
            for steps in self.history.steps.values()
        ]
        batches = max((s.epoch_batch for steps in in_epoch for s in steps), default=0)
        parts = [f"epoch {epoch + 1}: {batches} batches a core"]
        for name in self.history.names():
            last = [
                next((s.values[name] for s in run if name in s.values), None) for run in in_epoch
            ]
            last = [v for v in last if v is not None]
            if last:
                parts.append(f"{name} {sum(last) / len(last):.4g}")
        return ", ".join(parts)

    def _print(self, line):
        print(line, flush=True)
        self._last_line = self.clock()


class WidgetView(_View):
    """An ipywidgets progress bar and line over a live figure; at the end the widgets
    close and the final figure and line stay as plain outputs, saved with the notebook."""

    def __init__(self, history, watch, clock):
        super().__init__(history, watch, clock)
        import ipywidgets as widgets
        import matplotlib.figure  # noqa: F401 - imported now, not timed as a frame's drawing
        from IPython.display import display

        self.bar = widgets.IntProgress(min=0, max=1, value=0, bar_style="info")
        self.line = widgets.HTML("starting the cores...")
        self.image = widgets.Image(format="png")
        self.box = widgets.VBox([widgets.HBox([self.bar, self.line]), self.image])
        # A front end without the widgets extension shows the text instead of the box.
        bundle = self.box._repr_mimebundle_()
        bundle["text/plain"] = NO_WIDGETS
        self.handle = display(bundle, raw=True, display_id=True)
        self._next_line = self.start
        self._next_figure = self.start + FIGURE_SECONDS
        self._drawn_steps = -1
        self.lines = 0  # progress lines shown

    def update(self):
        now = self.clock()
        if now >= self._next_line:
            self._next_line = now + PROGRESS_SECONDS
            self._show_progress(self.snapshot())
        if now >= self._next_figure:
            steps = sum(len(s) for s in self.history.steps.values())
            if steps != self._drawn_steps:
                self._drawn_steps = steps
                png = self._figure(live=True)
                if png is not None:
                    self.image.value = png
                # The first frame also pays matplotlib's one-time set-up (0.9 s against
                # 0.3 s for the next ones, measured): it does not set the pace.
                took = self.clock() - now if self.figures > 1 else 0.0
                self._next_figure = self.clock() + max(FIGURE_SECONDS, took / FIGURE_SHARE)

    def close(self, failed):
        from IPython.display import HTML

        snapshot = self.snapshot()
        png = self._figure()
        state = "stopped" if failed else "done"
        # The widgets' output becomes the last line: the saved notebook keeps no dead widget.
        self.handle.update(HTML(f"<b>{state}</b>: {', '.join(snapshot.parts(final=True))}"))
        self.box.close()
        self._show_final_figure(png)

    def _show_progress(self, snapshot):
        if snapshot.epoch_batches:
            self.bar.max = snapshot.epoch_batches
            self.bar.value = min(snapshot.epoch_batch, snapshot.epoch_batches)
        self.line.value = " &middot; ".join(snapshot.parts())
        self.lines += 1


class Guarded:
    """``view`` whose drawing errors never stop a launch: the first one is warned about
    and the view is switched off."""

    def __init__(self, view):
        self.view = view
        self.broken = False

    def update(self):
        self._call(self.view.update)

    def close(self, failed):
        self._call(self.view.close, failed)

    def _call(self, method, *args):
        if self.broken:
            return
        try:
            method(*args)
        except Exception as error:  # noqa: BLE001 - drawing must never stop training
            self.broken = True
            warn(
                f"The live view stopped ({type(error).__name__}: {error}); the launch goes on "
                "and its history is kept: results.history.plot() draws it afterwards."
            )


@dataclasses.dataclass
class Snapshot:
    """Where a run stands: what every rank has done, and how fast."""

    elapsed: float
    steps: int  # steps of the slowest rank (of those heard from)
    epoch: int | None  # its epoch (0 for the first), None without a loader
    epoch_batch: int | None
    epoch_batches: int | None
    samples_per_second: float | None  # all cores, over the last seconds
    eta: float | None  # seconds to the end of the epoch at the slowest rank's pace
    compiles: int
    values: dict  # logged name -> mean over the ranks of their last value
    memory: tuple | None = None  # the fullest core's device memory (device_memory.Use)
    mean_samples_per_second: float | None = None  # all cores, over the whole run

    @classmethod
    def of(cls, history, compiles, elapsed):
        """From the tails of ``history`` only: cheap however long the run."""
        runs = [steps for steps in history.steps.values() if steps]  # ranks heard from
        slowest = min(runs, key=len, default=[])
        values = {}
        for name in history.names():
            last = [history.last_value(rank, name) for rank in history.steps]
            last = [v for v in last if v is not None]
            values[name] = sum(last) / len(last)  # a name is known once a rank logged it
        tail = slowest[-1] if slowest else None
        return cls(
            elapsed,
            len(slowest),
            getattr(tail, "epoch", None),
            getattr(tail, "epoch_batch", None),
            getattr(tail, "epoch_batches", None),
            history.current_samples_per_second(),
            _eta(slowest) if slowest else None,
            compiles,
            values,
            max(history.device_memory().values(), key=_fullness, default=None),
            history.mean_samples_per_second(),
        )

    def parts(self, final=False):
        """The line's parts, most important first."""
        parts = []
        if self.epoch is not None:
            of = f"/{self.epoch_batches}" if self.epoch_batches else ""
            parts.append(f"epoch {self.epoch + 1}, batch {self.epoch_batch}{of}")
        else:  # steps count syncs, epoch boundaries included: second best
            parts.append(f"step {self.steps}")
        parts += [f"{name} {value:.4g}" for name, value in self.values.items()]
        if final and self.mean_samples_per_second is not None:  # the run's, for comparing runs
            parts.append(f"{self.mean_samples_per_second:,.0f} samples/s over the run")
        elif self.samples_per_second is not None:
            parts.append(
                f"{self.samples_per_second:,.0f} samples/s over the last {RATE_OVER} steps"
            )
        parts.append(f"{self.compiles} compilations")
        if self.memory is not None:
            used, _, limit = self.memory
            of = f"/{limit / 2**30:.1f}" if limit else ""
            parts.append(f"device memory {used / 2**30:.1f}{of} GiB")
        if self.eta is not None and not final:
            parts.append(f"epoch ends in {_duration(self.eta)}")
        parts.append(f"{_duration(self.elapsed)} elapsed")
        return parts


def _fullness(use):
    """How full a device is, or, where it reports no limit, what it uses."""
    return (use.used / use.limit, 0) if use.limit else (0, use.used)


def _eta(steps, recent=20):
    last = steps[-1]
    if not last.epoch_batches or last.epoch_batch is None:
        return None
    earlier = steps[max(0, len(steps) - 1 - recent)]
    if earlier.epoch != last.epoch or last.time <= earlier.time:
        return None
    per_batch = (last.time - earlier.time) / (last.epoch_batch - earlier.epoch_batch or 1)
    return per_batch * (last.epoch_batches - last.epoch_batch)


def _duration(seconds):
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"
