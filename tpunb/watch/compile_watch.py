"""In the notebook, while a launch runs: the ranks' compilations and CPU fallbacks step by
step, with their cause (a batch shape not seen before, a short last batch, an op that ran
on the CPU, or a graph that changed for another reason), and the reads of device values
that cut a step or wait for the device, with their line; warned about once a cause, and
summed up at the end (``CompileSummary``, ``results.compiles``). The watch decides when a
cause is one; the ``_..._words`` functions say it: what happened, where, and the fix."""

from __future__ import annotations

import collections
import dataclasses

from tpunb import reports

# Steps whose compilations are expected: the sync before the first batch, the first
# training step, and the second, where optimizers such as Adam add their state.
WARMUP_STEPS = 3
# The same counted in batches of the training loader, for loops that sync more than once
# a batch (PyTorch Lightning syncs after the optimizer step and again in its loader).
WARMUP_BATCHES = 2
# And through the optimizer's second step (a step with gradient accumulation is several
# batches): the first creates the optimizer's state (Adam's moments), the second reads it.
WARMUP_OPTIMIZER_STEPS = 2

# What a step's compilations were, as the watch judged them: the warm-up's, a training
# step's own, or not a training step's (a framework's own step, the work after a rank's
# function, the launch's last step).
WARMUP, TRAINING, NOT_TRAINING = "warm-up", "training", "not training"

# A line that reads a value an execution is still computing (the host waits for the
# device) in this many steps after the warm-up is warned about.
WAITING_STEPS = 5
_READ_BACK = "aten::_local_scalar_dense"  # .item() and the like: a value read back
# The steps, from a step, whose new batch shapes may explain the step's compilations,
# nearest first: a compilation may be counted a step or two from its cause (read at the
# sync after it, or after a helper that read values ran).
_NEARBY = (0, -1, 1, 2)
_DID = {"cut": "cut", "wait": "waited in", "split": "split"}  # a read's kind, summed up

# What a step did, all ranks together: compilations ({rank: count}, one count a process,
# those the step itself may have caused: torch_xla's helpers' own left out), CPU fallbacks
# (op -> times), and the device values its ranks read ((kind, what, file, line): kind
# "cut", "wait" or "split", as ``history.Step.reads``).
_Register = collections.namedtuple("_Register", "compiles fallbacks reads")


# Why an op runs on the CPU, for the ops training code triggers most.
_FALLBACK_CAUSES = {
    "aten::_local_scalar_dense": (
        ".item(), float(t), int(t) or a Python if on a tensor: the step stops, its graph "
        "runs and the value is copied to the host. Log device tensors with tpunb.log(...) "
        "(read back in batches), or keep the test on the device with torch.where"
    ),
    "aten::nonzero": (
        "a boolean mask (x[mask]) or torch.nonzero: the result's shape depends on the data. "
        "Multiply by the mask, or use torch.where, to keep shapes fixed"
    ),
    "aten::masked_select": (
        "masked_select: the result's shape depends on the data. Multiply by the mask "
        "instead, to keep shapes fixed"
    ),
}

# Where a framework runs the loop: what it reads back itself.
_LIGHTNING_READS = (
    ". In PyTorch Lightning, self.log(..., prog_bar=True) makes one at every batch: "
    "Lightning reads the value back for its progress bar. Leave prog_bar out: the live "
    "view shows the value"
)


def _fallback_words(where, op, framework):
    """``op`` ran on the CPU at ``where`` ("epoch 1, batch 3"); ``framework``: a framework
    runs the loop."""
    why = _FALLBACK_CAUSES.get(op, "an op torch_xla has no XLA lowering for")
    if framework and op == "aten::_local_scalar_dense":
        why += _LIGHTNING_READS
    return (
        f"{where} ran {op} on the CPU (a fallback: the step's graph is cut there and data "
        f"goes through the host). Likely cause: {why}."
    )


def _read_words(where, kind, what, file, line, waiting_steps):
    """A read of a device value at ``file``, ``line``: ``kind`` "cut" (the step had not
    computed it yet) or "wait" (in ``waiting_steps`` steps, an execution was still
    computing it)."""
    if kind == "cut":
        why = (
            "read a value the step had not computed yet. torch_xla ran the step's graph up "
            "to that value there, and at the sync runs the step's graph as another, the work "
            "before the read included: two graphs a step, and work done twice."
        )
    else:
        why = (
            f"has waited for the device in {waiting_steps} steps: it read a value the step's "
            "execution was still computing. It cuts no graph, but each time the host stops "
            "there until the device is done, instead of tracing the next step meanwhile."
        )
    hint = _LIGHTNING_READS if "lightning" in file else ""
    return (
        f"{where}: {what} at {file}, line {line} {why} Read values after torch_xla.sync() "
        "only where needed, in xm.add_step_closure(...), or log them with tpunb.log(...), "
        f"read back in batches{hint}."
    )


def _split_words(where, what, file, line):
    """A sync of the program's at ``file``, ``line`` ended a step that another sync, in the
    same batch of the loader, ended again: the step ran as two graphs."""
    return (
        f"{where}: {what} at {file}, line {line} ran the step's work before its batch was "
        "done, and another sync in the same batch ran the work traced after it: two graphs "
        "per step instead of one, with a second dispatch and no fusion across the cut. "
        "torch_xla's loader (MpDeviceLoader, tpunb.shard) already syncs at every batch: "
        "remove this call, or move the work traced after it before it."
    )


# Distinct batch shapes a run may have without a warning: each compiles once, and a few
# is what padding to buckets gives (the messages below advise 4).
FEW_SHAPES = 4


def _compile_words(where, compiles, new, usual, shapes_so_far):
    """(key, message) for ``compiles`` new graphs at ``where``: ``new``, the batch shapes
    first seen there (none: the graph itself changed); ``usual``, the most common batch
    size; ``shapes_so_far``, the distinct shapes seen by then."""
    graphs = reports.count(compiles, "new graph")
    if not new:
        return "graph", (
            f"{where} compiled {graphs} with batch shapes seen before: the graph "
            "itself changed, e.g. a Python branch on a tensor value, a value that is a "
            "Python number one step and another the next, or a different code path "
            "(evaluation, logging). Keep the step's code path the same every step."
        )
    short = [key for key in new if key[0] and key[0][0] < usual]
    if short and len(short) == len(new):
        return "short batch", (
            f"{where} compiled {graphs}: batch shape {_format(short[0])} is smaller "
            f"than the usual batch of {usual}, the short last batch of an epoch. Build the "
            "DataLoader with drop_last=True, or pad it to the full batch with "
            f"tpunb.BucketCollate(..., batch_size={usual})."
        )
    return "shapes", (
        f"{where} compiled {graphs}: batch shape {_format(new[0])} not seen before; "
        f"{reports.count(shapes_so_far, 'distinct shape')} so far. Every new "
        "shape is a new graph to compile. Pad to buckets: DataLoader(..., collate_fn="
        f"tpunb.BucketCollate(tpunb.choose_buckets(lengths, {FEW_SHAPES}, batch_size=...))) "
        f"gives at most {FEW_SHAPES} shapes."
    )


def _format(key):
    return " and ".join(str(shape) for shape in key)


@dataclasses.dataclass(frozen=True, repr=False)
class CompileSummary(reports.Report):
    """Compilations of a launch and what caused them. torch_xla compiles and counts per
    process: the counts are those of the process that compiled most (on a v5e-8 each of
    the 8 processes compiles the graphs its own batches need, the same ones where every
    shard has the same shapes; ``all_processes_compiles`` sums them)."""

    compiles: int
    warmup_compiles: int
    helper_compiles: int  # graphs of xm.rendezvous, xm.mesh_reduce, step closures
    compile_seconds: float
    steps: int  # training steps: batches of the training loader (syncs without one)
    shapes: list  # distinct batch shapes, in the order first seen
    fallbacks: dict  # op name -> times it ran on the CPU, all processes together
    causes: list  # one line a cause seen after the warm-up
    processes: int = 1  # processes that reported compilations
    all_processes_compiles: int | None = None  # None: the same as ``compiles``

    @property
    def compiles_after_warmup(self) -> int:
        """The training steps' own compilations after the warm-up."""
        return self.compiles - self.warmup_compiles - self.helper_compiles

    def _content(self):
        rows = [
            ("compilations", self._compilations()),
            ("compile time", f"{self.compile_seconds:.1f} s"),
            ("training steps", str(self.steps)),
            ("batch shapes", str(len(self.shapes))),
        ]
        rows += [(f"CPU fallback {op}", f"{n} times") for op, n in self.fallbacks.items()]
        return "Compilations", rows, self.causes

    def _compilations(self):
        parts = [f"{self.warmup_compiles} in the warm-up"]
        if self.helper_compiles:
            parts.append(f"{self.helper_compiles} in torch_xla's rendezvous and step closures")
        if self.processes == 1:
            return f"{self.compiles} ({', '.join(parts)})"
        total = self.all_processes_compiles
        each = "in each" if total == self.compiles * self.processes else "at most, in one"
        return (
            f"{self.compiles} {each} of {self.processes} processes ({', '.join(parts)}; "
            f"{total} in all)"
        )


@dataclasses.dataclass
class _ProcessCounts:
    """One process's compilations so far (torch_xla counts them per process)."""

    compiles: int = 0
    warmup: int = 0
    helper: int = 0
    seconds: float = 0.0


class CompileWatch:
    """Fed the ranks' step records as they arrive; a step is analysed once every rank has
    reported it (compilations are counted per process, shapes per rank)."""

    def __init__(self, ranks, warmup_steps=WARMUP_STEPS):
        self.ranks = ranks
        self.warmup_steps = warmup_steps
        self._warmup_end = warmup_steps  # later after a framework's setup steps
        self._training_started = False  # has the training loader handed out a batch?
        self._pending = collections.defaultdict(dict)  # step -> {rank: Step}
        self._reported_through = dict.fromkeys(range(ranks), -1)
        self._registered = 0  # steps before this one are complete and counted
        self._next_step = 0  # steps before this one are judged
        self._last_step = float("inf")  # known once the launch ended
        self._registers = {}  # step -> _Register, until judged
        self._shapes = {}  # batch shape -> first step seen (ordered)
        # step -> the shapes new to a process there: first seen by that rank, since each
        # process (a rank, as on a v5e-8) compiles every shape it meets
        self._new_by_step = collections.defaultdict(list)
        self._rank_shapes = collections.defaultdict(set)  # rank -> the shapes it has met
        self._framework_steps = set()
        self._places = {}  # step -> where the training loop was: "epoch 2, batch 3"
        self._batch_sizes = collections.Counter()
        self._warned = set()
        self._processes = collections.defaultdict(_ProcessCounts)  # rank -> its process's counts
        self.fallbacks = collections.Counter()
        self.causes = {}  # cause key (a string, or ("cut", what, file, line)) -> message
        self._batches = set()  # (epoch, batch) of the training loader's batches seen
        self._reads_watched = False  # do the records name the reads that cut a step?
        self._read_steps = collections.Counter()  # (kind, what, file, line) -> steps seen
        self._verdicts = {}  # step -> what its compilations were, judged since last taken
        self._optimizer_steps = collections.Counter()  # rank -> optimizer steps so far
        self._between_passes = set()  # steps at or after a pass's last batch, till the next

    def add(self, rank, steps):
        """Takes a rank's new steps; returns the warnings they complete, once a cause."""
        for step in steps:
            self._pending[step.step][rank] = step
            self._reported_through[rank] = step.step
        return self._analyse(min(self._reported_through.values()), final=False)

    def finish(self):
        """Analyses the steps not every rank reached; returns their warnings."""
        self._last_step = max(self._pending, default=self._registered - 1)
        return self._analyse(self._last_step, final=True)

    @property
    def compiles(self):
        """Compilations so far of the process that compiled most."""
        return self._most_compiling().compiles

    def _most_compiling(self):
        # The lowest rank's process where processes compiled as many.
        rank = max(sorted(self._processes), key=lambda r: self._processes[r].compiles, default=None)
        return _ProcessCounts() if rank is None else self._processes[rank]

    def summary(self):
        counts = self._most_compiling()
        return CompileSummary(
            counts.compiles,
            counts.warmup,
            counts.helper,
            counts.seconds,
            # Training steps: the training loader's batches (a sync a step without one).
            len(self._batches) or self._registered,
            list(self._shapes),
            dict(self.fallbacks),
            [self._with_steps(key, message) for key, message in self.causes.items()],
            processes=max(1, len(self._processes)),
            all_processes_compiles=sum(p.compiles for p in self._processes.values()),
        )

    def _analyse(self, through, final):
        # A step is judged once the steps it may blame are complete (``_NEARBY``).
        while self._registered <= through:
            self._register(self._registered, self._pending.pop(self._registered, {}))
            self._registered += 1
        warnings = []
        while self._next_step < self._registered:
            if not final and self._next_step + max(_NEARBY) >= self._registered:
                break
            warnings += self._warnings_at(self._next_step)
            del self._registers[self._next_step]
            if not self._new_by_step.get(self._next_step):  # kept: a new shape's place
                self._places.pop(self._next_step, None)
            self._next_step += 1
        return warnings

    def _with_steps(self, key, message):
        """A cut's cause, with the steps it cut so far."""
        if key[0] not in _DID:
            return message
        steps = reports.count(self._read_steps[key], "step")
        return f"{message} It {_DID[key[0]]} {steps}."

    def _register(self, number, by_rank):
        framework = any(s.framework for s in by_rank.values())
        if framework:
            self._framework_steps.add(number)
            if not self._training_started:
                self._warmup_end = max(self._warmup_end, number + 1 + self.warmup_steps)
        if any(s.epoch == 0 and (s.epoch_batch or 0) <= WARMUP_BATCHES for s in by_rank.values()):
            self._warmup_end = max(self._warmup_end, number + 1)
        # An epoch's end: its last batch's step runs on into the work after the pass
        # (evaluating, reducing metrics, saving, predicting), as do the steps after it
        # until the next pass.
        if any(
            s.epoch_batches and (s.epoch_batch or 0) >= s.epoch_batches for s in by_rank.values()
        ):
            self._between_passes.add(number)
        # Until the optimizer's second step, with gradient accumulation batches later.
        for rank, s in by_rank.items():
            if s.optimizer_steps and self._optimizer_steps[rank] < WARMUP_OPTIMIZER_STEPS:
                self._warmup_end = max(self._warmup_end, number + 1)
            self._optimizer_steps[rank] += s.optimizer_steps
        self._training_started |= any(s.epoch is not None for s in by_rank.values())
        for s in by_rank.values():
            if s.epoch is not None and s.epoch_batch:
                self._places[number] = f"epoch {s.epoch + 1}, batch {s.epoch_batch}"
                self._batches.add((s.epoch, s.epoch_batch))
                break
        reports = [s for s in by_rank.values() if s.compiles is not None]
        compiles = {}
        for rank, s in by_rank.items():
            if s.compiles is None:
                continue
            counts = self._processes[rank]
            counts.compiles += s.compiles
            counts.helper += s.helper_compiles or 0
            counts.seconds += s.compile_seconds
            compiles[rank] = s.compiles - (s.helper_compiles or 0)
        fallbacks = collections.Counter()
        for s in reports:
            fallbacks.update(s.fallbacks)
        self.fallbacks.update(fallbacks)
        for rank in sorted(by_rank):
            for batch in by_rank[rank].shapes:
                key = _shape_key(batch)
                new_here = key not in self._rank_shapes[rank]  # new to the rank's process
                self._shapes.setdefault(key, number)
                if new_here and key not in self._new_by_step[number]:
                    self._new_by_step[number].append(key)
                self._rank_shapes[rank].add(key)
                self._batch_sizes[key[0][0] if key[0] else 1] += 1
        reads = {tuple(read[:4]) for s in by_rank.values() for read in s.reads or ()}
        self._reads_watched |= any(s.reads is not None for s in by_rank.values())
        self._registers[number] = _Register(compiles, fallbacks, reads)

    def _warnings_at(self, number):
        by_process, fallbacks, reads = self._registers[number]
        read_causes = self._read_causes(number, reads)
        if number < self._warmup_end:
            self._count_warmup(number, by_process)
            return self._new_warnings(read_causes)
        # A framework's own steps (Lightning's epoch ends, validation, teardown) compile
        # their graphs once, in code the notebook does not control.
        if number in self._framework_steps:
            self._verdicts[number] = NOT_TRAINING
            return []
        self._verdicts[number] = TRAINING
        # After the last sync (the launch's last step, which holds a rank's work after its
        # function) a read such as `return loss.item()` takes a computed value: it cuts no
        # step (the reads after a rank's last sync are never recorded).
        after_training = number == self._last_step
        causes = read_causes + [
            (f"fallback {op}", self._fallback_message(number, op))
            for op in fallbacks
            # Where reads are watched they name the reads that cut, with their line; the
            # reads of computed values this op also counts cut nothing.
            if not after_training and not (self._reads_watched and op == _READ_BACK)
        ]
        # The new shapes that explain the compilations: this step's, else the nearest.
        shaped_at = next((number + n for n in _NEARBY if self._new_at(number + n)), None)
        compiles = max(by_process.values(), default=0)  # graphs new to a process
        if compiles:
            new = self._new_at(shaped_at) if shaped_at is not None else []
            cause = self._compile_cause(number if shaped_at is None else shaped_at, compiles, new)
            # Expected graphs of their own: the work after a rank's function (evaluating,
            # gathering results), the launch's last step, the work between the training
            # loader's passes (evaluating, reducing metrics, predicting: each path compiled
            # the first time it runs; a changed graph is judged inside the passes, where
            # every step runs the same code), and a framework step's work read a step early
            # or run in the step after it.
            expected = (
                after_training
                or number in self._between_passes
                or any(number + n in self._framework_steps for n in (-1, 0, 1))
            )
            few = self._shapes_through(shaped_at or number) <= FEW_SHAPES
            if cause[0] == "shapes" and few:
                pass  # a bucket's first batch: a few shapes, each compiled once
            elif cause[0] != "graph" or not expected:
                causes.append(cause)
            else:
                self._verdicts[number] = NOT_TRAINING
        return self._new_warnings(causes)

    def _new_warnings(self, causes):
        warnings = []
        for key, message in causes:
            self.causes.setdefault(key, message)
            if key not in self._warned:
                self._warned.add(key)
                warnings.append(message)
        return warnings

    def _read_causes(self, number, reads):
        """Causes for the device values read in step ``number``: at once for a read that
        cut the step; for a read of a computed value (the host waits for the device), once
        the same line has read in ``WAITING_STEPS`` steps after the warm-up. A framework's
        own steps' are the framework's: not the notebook's to change."""
        if number in self._framework_steps:
            return []
        causes = []
        for key in sorted(reads):
            self._read_steps[key] += 1
            if key[0] == "split":
                causes.append((key, _split_words(self._place(number), *key[1:])))
            elif key[0] == "cut" or (
                self._read_steps[key] >= WAITING_STEPS and number >= self._warmup_end
            ):
                message = _read_words(self._place(number), *key, WAITING_STEPS)
                causes.append((key, message))
        return causes

    def _count_warmup(self, number, by_process):
        self._verdicts[number] = WARMUP
        for rank, compiles in by_process.items():
            self._processes[rank].warmup += compiles

    def take_verdicts(self):
        """{step: WARMUP, TRAINING or NOT_TRAINING} of the steps judged since the last call:
        what the step's compilations were (``history.History.judge`` keeps them, the
        figure draws them so)."""
        verdicts, self._verdicts = self._verdicts, {}
        return verdicts

    def _place(self, number):
        """Where step ``number`` was, as a learner counts: "epoch 2, batch 3" (a step a
        torch_xla.sync() where no torch_xla loader hands out the batches)."""
        return self._places.get(number, f"step {number}")

    def _shapes_through(self, number):
        return sum(1 for first in self._shapes.values() if first <= number)

    def _new_at(self, number):
        return self._new_by_step.get(number, []) if number >= self._warmup_end else []

    def _compile_cause(self, number, compiles, new):
        usual = self._batch_sizes.most_common(1)[0][0] if new else None
        shapes = self._shapes_through(number)
        return _compile_words(self._place(number), compiles, new, usual, shapes)

    def _fallback_message(self, number, op):
        return _fallback_words(self._place(number), op, bool(self._framework_steps))


def _shape_key(batch):
    return tuple(tuple(shape) for shape in batch)
