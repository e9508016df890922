"""What a launch recorded, per rank and per step: values given to ``tpunb.log``, batch
shapes, samples, compilations. Plain data, to plot again or save after the run."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, NamedTuple

from tpunb.watch import device_memory

if TYPE_CHECKING:
    import os
    from collections.abc import Iterable
    from typing import Any

    from matplotlib.figure import Figure


@dataclasses.dataclass
class Step:
    """One step of one rank: what happened between two of its ``torch_xla.sync()``.

    ``compiles``, ``cached``, ``compile_seconds`` and ``fallbacks`` are the rank's
    process's (torch_xla counts per process; each rank is a process), None where the
    compile watch was left out. ``shapes`` has one entry a batch the loader handed out in
    the step."""

    step: int
    time: float  # seconds since the launch started
    values: dict
    shapes: list
    samples: int
    compiles: int | None = None
    cached: int | None = None
    compile_seconds: float | None = None
    fallbacks: dict | None = None
    # Progress through the first loader the rank iterated (its training loader): the
    # epoch (0 for the first pass), batches handed out so far in it, and batches a pass
    # (None when the loader has no length). None before that loader's first batch.
    epoch: int | None = None
    epoch_batch: int | None = None
    epoch_batches: int | None = None
    # A step of a framework's own setup or teardown (Lightning's), not of training.
    framework: bool = False
    # Of ``compiles``, those of torch_xla's helpers that read values after a sync
    # (xm.rendezvous, xm.mesh_reduce, step closures): their own graphs, not the step's.
    helper_compiles: int | None = None
    # Reads of device values, each [kind, what, file, line, times]: kind "cut" where the
    # step had not computed the value yet (its pending graph ran up to it), "wait" where an
    # execution was still computing it (the host waited for the device), "split" where
    # what, file and line are the program's own sync, which ran the step's work before a
    # second sync in the same batch of the loader ran the rest. None where reads were not
    # watched.
    reads: list | None = None
    # The rank's device memory (bytes in use, peak, limit) when the record was sent, where
    # the device reports it (a TPU; not XLA's CPU client): ``device_memory.Use``.
    memory: tuple | None = None
    # Optimizer steps taken in the step (torch.optim's, through its global post-step
    # hook): the warm-up lasts until the second, which adds Adam's state to the graph.
    optimizer_steps: int = 0


def _training_steps(steps):
    """The training step each record ends in, and the training steps after which a new
    epoch begins. A training step is a batch of the training loader: the k-th batch a rank
    was handed out, counted across epochs, is its step k; records before the first batch
    are at 0, and the syncs a loop makes besides its steps (an epoch's end, a framework's
    own) share the step before them. A rank that read no batch through a torch_xla loader
    has a step a ``torch_xla.sync()``."""
    xs, epoch_starts = [], []
    start = done = 0
    epoch = None
    for s in steps:
        if s.epoch is not None and s.epoch_batch:
            if s.epoch != epoch:
                if epoch is not None:
                    start = done
                    epoch_starts.append(start)
                epoch = s.epoch
            done = start + s.epoch_batch
        xs.append(done)
    if epoch is None:  # no torch_xla loader: each sync ends a step
        return [s.step for s in steps], []
    return xs, epoch_starts


RATE_OVER = 10  # steps: the samples/s of the live view and the figure are a trailing mean


def _rates(steps, over):
    """One rank's samples/s at each of its training steps after the first, over the last
    ``over`` of them: a training step is a record that carries samples (a batch of the
    training loader); the records between two (an epoch's end, a validation) add their time
    to the window, not points of their own. A running sum, cheap however long the run.
    Returns the training steps' positions in ``steps`` and the rates."""
    marks = [i for i, s in enumerate(steps) if s.samples]
    numbers, rates = [], []
    in_window = 0  # the samples of marks[max(0, k - over) + 1 : k + 1]
    for k in range(1, len(marks)):
        in_window += steps[marks[k]].samples
        if k > over:
            in_window -= steps[marks[k - over]].samples
        span = steps[marks[k]].time - steps[marks[max(0, k - over)]].time
        if span > 0:
            numbers.append(marks[k])
            rates.append(in_window / span)
    return numbers, rates


def _last_training_steps(steps, count):
    """The tail of ``steps`` that holds its last ``count`` training steps (records that
    carry samples), and the records after them."""
    seen = 0
    for position in range(len(steps) - 1, -1, -1):
        seen += bool(steps[position].samples)
        if seen == count:
            return steps[position:]
    return steps


class CompilesAt(NamedTuple):
    """A training step's compilations (``History.compiles_per_step``)."""

    step: int
    compiles: int
    seconds: float
    not_training: int
    warmup: int


class History:
    """``history.steps[rank]`` is the list of that rank's steps, in order (see
    ``Step``). ``rows()`` flattens them to dicts; ``save`` and
    ``load`` keep them as JSON; ``plot()`` draws loss, throughput and compilations per step."""

    rate_over = RATE_OVER  # steps a samples/s figure is the trailing mean of

    def __init__(self, ranks: int) -> None:
        self.steps = {rank: [] for rank in range(ranks)}
        self._names = {}  # logged names in the order first seen, kept as steps arrive
        self._last = {rank: {} for rank in range(ranks)}  # rank -> name -> last value
        self._memory = {}  # rank -> its device's last measured memory (device_memory.Use)
        self._progress_of = {}  # rank -> (records, _training_steps of them)
        self.verdicts = {}  # step -> what its compilations were, as the compile watch judged
        self._samples = 0  # all ranks' samples so far

    def add(self, rank: int, steps: Iterable[Step]) -> None:
        self.steps[rank].extend(steps)
        for step in steps:
            self._samples += step.samples
            self._names.update(dict.fromkeys(step.values))
            self._last[rank].update(step.values)
            if step.memory is not None:
                self._memory[rank] = device_memory.Use(*step.memory)

    def device_memory(self) -> dict[int, device_memory.Use]:
        """Each core's last measured device memory, by rank; empty where the device does
        not report it (simulated cores)."""
        return dict(self._memory)

    def last_value(self, rank: int, name: str) -> float | None:
        """The last value ``rank`` logged under ``name``, however long ago; None if never."""
        return self._last[rank].get(name)

    @property
    def ranks(self) -> int:
        return len(self.steps)

    @property
    def seconds(self) -> float:
        """Seconds from the launch's start to the last step any rank recorded."""
        return max((steps[-1].time for steps in self.steps.values() if steps), default=0.0)

    def names(self) -> list[str]:
        """The names given to ``tpunb.log``, in the order first seen."""
        return list(self._names)

    def training_steps(self, rank: int) -> list[int]:
        """The training step of each of ``rank``'s records (``steps[rank]``): the batches
        of the training loader it had been handed out by then, counted across epochs."""
        return self._progress(rank)[0]

    def epoch_starts(self) -> list[int]:
        """The training steps after which a new epoch began (on rank 0)."""
        return self._progress(0)[1]

    def _progress(self, rank):
        # Worked out once for the records so far: a figure asks for it once a panel.
        count, progress = self._progress_of.get(rank, (None, None))
        if count != len(self.steps[rank]):
            progress = _training_steps(self.steps[rank])
            self._progress_of[rank] = (len(self.steps[rank]), progress)
        return progress

    def values(self, name: str) -> dict[int, tuple[list[int], list[float]]]:
        """{rank: ([training step, ...], [value, ...])} where ``name`` was logged."""
        found = {}
        for rank, steps in self.steps.items():
            at = self.training_steps(rank)
            pairs = [
                (x, s.values[name]) for x, s in zip(at, steps, strict=True) if name in s.values
            ]
            if pairs:
                found[rank] = tuple(map(list, zip(*pairs, strict=True)))
        return found

    def judge(self, verdicts: dict[int, str]) -> None:
        """Keeps the compile watch's verdicts ({step: "warm-up", "training" or "not
        training"}): what each step's compilations were."""
        self.verdicts.update(verdicts)

    def compiles_per_step(self) -> list[CompilesAt]:
        """The compilations of the process that compiled most (torch_xla compiles and counts
        per process; on a v5e-8 each process compiles what its own batches need) at each step
        where it compiled, as the compile watch judged them (its summary counts the same);
        compilations before the first batch are at step 0. ``not_training``: those of
        torch_xla's helpers (xm.rendezvous, xm.mesh_reduce, step closures) and of steps
        that are not a training step's (a framework's own, the work after a rank's
        function); ``warmup``: the warm-up's. Both are counted in ``compiles`` too."""
        reporters = {
            rank: sum(s.compiles for s in steps if s.compiles is not None)
            for rank, steps in self.steps.items()
            if any(s.compiles is not None for s in steps)
        }
        if not reporters:
            return []
        rank = max(sorted(reporters), key=reporters.get)  # the lowest rank where equal
        totals = {}
        for x, s in zip(self.training_steps(rank), self.steps[rank], strict=True):
            if s.compiles is None:
                continue
            verdict = self.verdicts.get(s.step, "training")  # not judged yet: the step's
            helpers = s.helper_compiles or 0
            count, seconds, other, warmup = totals.get(x, (0, 0.0, 0, 0))
            totals[x] = (
                count + s.compiles,
                seconds + s.compile_seconds,
                other + (s.compiles if verdict == "not training" else helpers),
                warmup + (s.compiles - helpers if verdict == "warm-up" else 0),
            )
        return [CompilesAt(x, *totals[x]) for x in sorted(totals)]

    def samples_per_second(
        self, rank: int | None = None, over: int = RATE_OVER
    ) -> tuple[list[int], list[float]]:
        """([training step, ...], [samples/s, ...]) of ``rank``, each over its last
        ``over`` training steps (timed in the rank). ``rank=None``: all ranks together, at the
        training steps every rank has."""
        if rank is not None:
            return self._rates_at_training_steps(rank, over)
        per_rank = [
            dict(zip(*self._rates_at_training_steps(r, over), strict=True)) for r in self.steps
        ]
        steps = sorted(set.intersection(*(set(rates) for rates in per_rank)))
        return steps, [sum(rates[step] for rates in per_rank) for step in steps]

    def _rates_at_training_steps(self, rank, over):
        at = self.training_steps(rank)
        positions, rates = _rates(self.steps[rank], over)
        return [at[p] for p in positions], rates

    def current_samples_per_second(self, over: int = RATE_OVER) -> float | None:
        """All ranks' samples/s over their last ``over`` steps (None before that can be
        told): from the tails only, cheap however long the run."""
        rates = [
            _rates(_last_training_steps(steps, over + 1), over)[1] for steps in self.steps.values()
        ]
        return sum(r[-1] for r in rates) if all(rates) else None

    def mean_samples_per_second(self) -> float | None:
        """All ranks' samples over the seconds from the launch's start to the last step:
        the run's rate, its compilations and waits included (None before a sample)."""
        return self._samples / self.seconds if self._samples and self.seconds else None

    def rows(self) -> list[dict[str, Any]]:
        """Every step of every rank as a plain dict (rank first), for pandas or a CSV."""
        return [
            {"rank": rank, **dataclasses.asdict(step)}
            for rank, steps in self.steps.items()
            for step in steps
        ]

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as file:
            json.dump({"ranks": self.ranks, "rows": self.rows(), "verdicts": self.verdicts}, file)

    @classmethod
    def load(cls, path: str | os.PathLike) -> History:
        with open(path) as file:
            saved = json.load(file)
        history = cls(saved["ranks"])
        for row in saved["rows"]:
            rank = row.pop("rank")
            row["shapes"] = [[tuple(shape) for shape in batch] for batch in row["shapes"]]
            for retired in ("process_steps", "process_closing"):  # saved before 2026-11-28
                row.pop(retired, None)
            history.add(rank, [Step(**row)])
        history.judge({int(step): verdict for step, verdict in saved.get("verdicts", {}).items()})
        return history

    def plot(self, **figure_options: Any) -> Figure:
        """A matplotlib figure of the run: logged values per core, samples/s, compilations."""
        from tpunb import plots
        from tpunb.watch import history_figure

        return plots.shown_in_notebooks(history_figure.history_figure(self, **figure_options))

    def __repr__(self):
        counts = {len(steps) for steps in self.steps.values()}
        steps = counts.pop() if len(counts) == 1 else f"{min(counts)}-{max(counts)}"
        return f"<History: {self.ranks} ranks, {steps} steps each, values {self.names()}>"
