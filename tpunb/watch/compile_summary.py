"""The summary of a launch's compilations, as ``results.compiles`` shows it: how many, how
many in the warm-up and in torch_xla's helpers, their time, the training steps and batch
shapes, the CPU fallbacks, and a line a cause. The compile watch (``compile_watch.py``)
makes it."""

from __future__ import annotations

import dataclasses

from tpunb.wording import reports


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
