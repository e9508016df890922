"""What a rank tells the notebook, as typed records: every message sent over a launch's
channel is one of these (and nothing else is).

    Steps     a rank's finished steps (``Step`` records), sent in batches while it runs
    Raised    a rank's error, with its traceback, or a result that cannot be sent back
    Returned  the results of a process's ranks, once all of them have returned
    Ended     put in the notebook's own inbox when the launcher returned (never sent)
"""

import dataclasses
import typing


@dataclasses.dataclass
class Step:
    """One step of one rank: what happened between two of its ``torch_xla.sync()``.

    ``compiles``, ``cached``, ``compile_seconds`` and ``fallbacks`` are the process's
    (torch_xla counts per process), set only on the rank that reports them (None on the
    others); ``shapes`` has one entry a batch the loader handed out in the step."""

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


class Steps(typing.NamedTuple):
    rank: int
    steps: list  # of Step, in order


class Raised(typing.NamedTuple):
    rank: int
    description: str  # "raised ValueError: ...", with the likely cause when known
    traceback: str | None  # the rank's own traceback text; None when it did not raise


class Returned(typing.NamedTuple):
    results: list  # (rank, pickled result) of every rank of one process


class Ended(typing.NamedTuple):
    error: str | None  # what the launcher raised, if it did
