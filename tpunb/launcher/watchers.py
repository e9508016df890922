"""What a launch watches, behind one seam. A ``Watcher`` may put hooks in place for the
ranks (``in_ranks``: entered in the notebook's process before the fork, which hands them to
the ranks), read the steps the ranks record (``add``), look at the ranks at each of the
supervisor's checks (``check``) and once they have ended (``finish``); each returns its
warnings. The supervisor calls the launch's watchers in turn; a plan leaves out those it
names (``Plan.unwatched``), and ``benchmarks/launch.py`` prints what each costs:

    compiles     a step's compilations and CPU fallbacks, and their cause
    reads        reads of device values that cut a step or wait for the device, and
                 syncs that split one (a cause the compile watch names)
    collectives  each rank's collective calls, compared: ranks that took different paths
    memory       each core's device memory, warned about near its limit
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

from tpunb.launcher import hooks
from tpunb.launcher.preflight import WATCHERS
from tpunb.watch import collective_calls, compile_watch, device_memory

if TYPE_CHECKING:
    from tpunb.launcher.rank import Job
    from tpunb.watch.compile_watch import CompileSummary
    from tpunb.watch.history import History, Step

NAMES = WATCHERS


class Watcher:
    """One thing a launch watches; every part does nothing unless a watcher says what."""

    name: ClassVar[str]

    def in_ranks(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def add(self, rank: int, steps: list[Step]) -> list[str]:
        return []

    def check(self) -> list[str]:
        return []

    def finish(self) -> list[str]:
        return []


class Compiles(Watcher):
    """The compile watch: its verdict on each step (warm-up or training) goes to the
    history, which the figure draws."""

    name = "compiles"

    def __init__(self, cores: int, history: History) -> None:
        self.watch = compile_watch.CompileWatch(cores)
        self.history = history

    def add(self, rank: int, steps: list[Step]) -> list[str]:
        warnings = self.watch.add(rank, steps)
        self.history.judge(self.watch.take_verdicts())
        return warnings

    def finish(self) -> list[str]:
        # The steps no later one completed are judged now: the final figure draws every
        # step's compilations as the summary counts them.
        warnings = self.watch.finish()
        self.history.judge(self.watch.take_verdicts())
        return warnings

    def summary(self) -> CompileSummary:
        return self.watch.summary()


class Reads(Watcher):
    """Reads of device values in the ranks, and the helpers whose reads are excused."""

    name = "reads"

    def in_ranks(self) -> contextlib.AbstractContextManager[Any]:
        return hooks.reads_recorded()


class Collectives(Watcher):
    """Each rank's collective calls in shared memory, compared as they are made; a
    divergence stops the launch (``divergence``)."""

    name = "collectives"

    def __init__(self, job: Job) -> None:
        self.calls = collective_calls.Judge(job.ledger)
        self.divergence: collective_calls.Divergence | None = None

    def in_ranks(self) -> contextlib.AbstractContextManager[Any]:
        return hooks.collectives_recorded()

    def check(self, final: bool = False) -> list[str]:
        warnings, self.divergence = self.calls.check(final=final)
        return warnings

    def finish(self) -> list[str]:
        return self.calls.check(final=True)[0]  # calls made since the last check


class Memory(Watcher):
    """Each core's device memory, as the ranks read it with their steps."""

    name = "memory"

    def __init__(self) -> None:
        self.watch = device_memory.NearLimit()

    def add(self, rank: int, steps: list[Step]) -> list[str]:
        return self.watch.add(rank, steps)


def of_launch(job: Job, history: History) -> dict[str, Watcher]:
    """The launch's watchers by name, less those its plan leaves out."""
    made = {
        "compiles": lambda: Compiles(job.plan.cores, history),
        "reads": Reads,
        "collectives": lambda: Collectives(job),
        "memory": Memory,
    }
    assert tuple(made) == WATCHERS
    return {name: make() for name, make in made.items() if job.plan.watches(name)}
