"""In the notebook, while a launch runs: the ranks' compilations and CPU fallbacks step by
step, with their cause (a batch shape not seen before, a short last batch, an op that ran
on the CPU, or a graph that changed for another reason), warned about once a cause after
the warm-up, and summed up at the end."""

import collections
import dataclasses

from tpunb import reports

# Steps whose compilations are expected: the sync before the first batch, the first
# training step, and the second, where optimizers such as Adam add their state.
WARMUP_STEPS = 3
# The same counted in batches of the training loader, for loops that sync more than once
# a batch (PyTorch Lightning syncs after the optimizer step and again in its loader).
WARMUP_BATCHES = 2

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

# Where a framework runs the loop (its own steps seen): what it reads back itself.
_FRAMEWORK_FALLBACK_CAUSES = {
    "aten::_local_scalar_dense": (
        ". In PyTorch Lightning, self.log(..., prog_bar=True) makes one at every batch: "
        "Lightning reads the value back for its progress bar. Leave prog_bar out: the live "
        "view shows the value"
    ),
}

# What a step did, all ranks together: compilations, CPU fallbacks (op -> times), the
# steps the processes' ranks were in meanwhile (lowest, highest; None when unknown), and
# whether one of them was in its work after its function returned.
_Register = collections.namedtuple("_Register", "compiles fallbacks span closing")
# compiles: those the step itself may have caused (torch_xla's helpers' own left out)


@dataclasses.dataclass(frozen=True, repr=False)
class CompileSummary(reports.Report):
    """Compilations of a launch (all processes together) and what caused them."""

    compiles: int
    warmup_compiles: int
    helper_compiles: int  # graphs of xm.rendezvous, xm.mesh_reduce, step closures
    compile_seconds: float
    steps: int  # training steps: batches of the training loader (syncs without one)
    shapes: list  # distinct batch shapes, in the order first seen
    fallbacks: dict  # op name -> times it ran on the CPU
    causes: list  # one line a cause seen after the warm-up

    @property
    def compiles_after_warmup(self):
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
        return f"{self.compiles} ({', '.join(parts)})"


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
        self._new_by_step = collections.defaultdict(list)  # step -> shapes first seen there
        self._framework_steps = set()
        self._places = {}  # step -> where the training loop was: "epoch 2, batch 3"
        self._batch_sizes = collections.Counter()
        self._warned = set()
        self.compiles = self.warmup_compiles = self.helper_compiles = 0
        self.compile_seconds = 0.0
        self.fallbacks = collections.Counter()
        self.causes = {}  # cause key -> message
        self._batches = set()  # (epoch, batch) of the training loader's batches seen

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

    def summary(self):
        return CompileSummary(
            self.compiles,
            self.warmup_compiles,
            self.helper_compiles,
            self.compile_seconds,
            # Training steps: the training loader's batches (a sync a step without one).
            len(self._batches) or self._registered,
            list(self._shapes),
            dict(self.fallbacks),
            list(self.causes.values()),
        )

    def _analyse(self, through, final):
        # Compilations are counted per process, shapes per rank. Where ranks share a process
        # they may be steps apart (no collective keeps them in step), so a compilation
        # counted in the reporting rank's step can be another rank's, steps before or
        # after. A step is judged once every step its process's ranks were in meanwhile,
        # and the next, is complete: its compilations are blamed on a new shape there.
        while self._registered <= through:
            self._register(self._registered, self._pending.pop(self._registered, {}))
            self._registered += 1
        warnings = []
        while self._next_step < self._registered:
            register = self._registers[self._next_step]
            highest = register.span[1] if register.span else self._next_step
            if not final and highest + 1 >= self._registered:
                break
            warnings += self._warnings_at(self._next_step)
            del self._registers[self._next_step]
            if not self._new_by_step.get(self._next_step):  # kept: a new shape's place
                self._places.pop(self._next_step, None)
            self._next_step += 1
        return warnings

    def _register(self, number, by_rank):
        framework = any(s.framework for s in by_rank.values())
        if framework:
            self._framework_steps.add(number)
            if not self._training_started:
                self._warmup_end = max(self._warmup_end, number + 1 + self.warmup_steps)
        if any(s.epoch == 0 and (s.epoch_batch or 0) <= WARMUP_BATCHES for s in by_rank.values()):
            self._warmup_end = max(self._warmup_end, number + 1)
        self._training_started |= any(s.epoch is not None for s in by_rank.values())
        for s in by_rank.values():
            if s.epoch is not None and s.epoch_batch:
                self._places[number] = f"epoch {s.epoch + 1}, batch {s.epoch_batch}"
                self._batches.add((s.epoch, s.epoch_batch))
                break
        reports = [s for s in by_rank.values() if s.compiles is not None]
        spans = [s.process_steps for s in reports if s.process_steps is not None]
        span = (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None
        compiles = sum(s.compiles for s in reports)
        self.compiles += compiles
        helpers = sum(s.helper_compiles or 0 for s in reports)
        self.helper_compiles += helpers
        compiles -= helpers
        self.compile_seconds += sum(s.compile_seconds for s in reports)
        fallbacks = collections.Counter()
        for s in reports:
            fallbacks.update(s.fallbacks)
        self.fallbacks.update(fallbacks)
        for rank in sorted(by_rank):
            for batch in by_rank[rank].shapes:
                key = _shape_key(batch)
                if key not in self._shapes:
                    self._shapes[key] = number
                    self._new_by_step[number].append(key)
                self._batch_sizes[key[0][0] if key[0] else 1] += 1
        closing = any(s.process_closing for s in reports)
        self._registers[number] = _Register(compiles, fallbacks, span, closing)

    def _warnings_at(self, number):
        compiles, fallbacks, span, closing = self._registers[number]
        if number < self._warmup_end:
            self.warmup_compiles += compiles
            return []
        # A framework's own steps (Lightning's epoch ends, validation, teardown) compile
        # their graphs once, in code the notebook does not control.
        if number in self._framework_steps:
            return []
        lowest, highest = span or (number, number)
        # After the last sync (the launch's last step, or a rank's work after its function)
        # a read such as `return loss.item()` takes a computed value: it cuts no step. A
        # rank past the last step (its function not yet returned) may be the one that read.
        after_training = number == self._last_step or closing or highest > self._last_step
        causes = [
            (f"fallback {op}", self._fallback_message(number, op))
            for op in fallbacks
            if not after_training
        ]
        # The new shapes that explain the compilations: this step's, else the nearest of
        # the steps the process's ranks were in meanwhile (and one either side).
        around = sorted(range(lowest - 1, highest + 2), key=lambda n: abs(n - number))
        shaped_at = next((n for n in around if self._new_at(n)), None)
        if compiles and shaped_at is None and lowest < self._warmup_end:
            self.warmup_compiles += compiles  # a rank was still in its warm-up
        elif compiles:
            new = self._new_at(shaped_at) if shaped_at is not None else []
            cause = self._compile_cause(number if shaped_at is None else shaped_at, compiles, new)
            # Expected graphs of their own: the work after a rank's function (evaluating,
            # gathering results), the launch's last step, and a framework step's work read
            # a step early or run in the step after it.
            expected = after_training or any(n in self._framework_steps for n in around)
            if cause[0] != "graph" or not expected:
                causes.append(cause)
        warnings = []
        for key, message in causes:
            self.causes.setdefault(key, message)
            if key not in self._warned:
                self._warned.add(key)
                warnings.append(message)
        return warnings

    def _place(self, number):
        """Where step ``number`` was, as a learner counts: "epoch 2, batch 3" (a step a
        torch_xla.sync() where no torch_xla loader hands out the batches)."""
        return self._places.get(number, f"step {number}")

    def _shapes_through(self, number):
        return sum(1 for first in self._shapes.values() if first <= number)

    def _new_at(self, number):
        return self._new_by_step.get(number, []) if number >= self._warmup_end else []

    def _compile_cause(self, number, compiles, new):
        graphs = reports.count(compiles, "new graph")
        where = self._place(number)
        if not new:
            return "graph", (
                f"{where} compiled {graphs} with batch shapes seen before: the graph "
                "itself changed, e.g. a Python branch on a tensor value, a value that is a "
                "Python number one step and another the next, or a different code path "
                "(evaluation, logging). Keep the step's code path the same every step."
            )
        usual = self._batch_sizes.most_common(1)[0][0]
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
            f"{reports.count(self._shapes_through(number), 'distinct shape')} so far. Every new "
            "shape is a new graph to compile. Pad to buckets: DataLoader(..., collate_fn="
            "tpunb.BucketCollate(tpunb.choose_buckets(lengths, 4, batch_size=...))) gives at "
            "most 4 shapes."
        )

    def _fallback_message(self, number, op):
        why = _FALLBACK_CAUSES.get(op, "an op torch_xla has no XLA lowering for")
        if self._framework_steps:
            why += _FRAMEWORK_FALLBACK_CAUSES.get(op, "")
        return (
            f"{self._place(number)} ran {op} on the CPU (a fallback: the step's graph is cut there "
            f"and data goes through the host). Likely cause: {why}."
        )


def _shape_key(batch):
    return tuple(tuple(shape) for shape in batch)


def _format(key):
    return " and ".join(str(shape) for shape in key)
