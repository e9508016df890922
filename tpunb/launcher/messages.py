"""What a rank tells the notebook, as typed records: every message sent over a launch's
channel is one of these (and nothing else is).

    Steps     a rank's finished steps (``history.Step``'s fields), sent in batches while it runs
    Raised    a rank's error, with its traceback, or a result that cannot be sent back
    Returned  the results of a process's ranks, once all of them have returned
    Ended     put in the notebook's own inbox when the launcher returned (never sent)
"""

import dataclasses
import operator
import typing

from tpunb.watch.history import Step

_STEP_FIELDS = operator.attrgetter(*(field.name for field in dataclasses.fields(Step)))


class Steps(typing.NamedTuple):
    """Sent as each step's fields: a tuple pickles in half the time a record takes, in the
    rank and in the notebook."""

    rank: int
    fields: list[tuple]  # each step's fields, in order

    @classmethod
    def of(cls, rank, steps):
        return cls(rank, [_STEP_FIELDS(step) for step in steps])

    def steps(self):
        """The ``history.Step`` records, in order."""
        return [Step(*fields) for fields in self.fields]


class Raised(typing.NamedTuple):
    rank: int
    description: str  # "raised ValueError: ...", with the likely cause when known
    traceback: str | None  # the rank's own traceback text; None when it did not raise
    # RankEnded, CollectiveMismatch: stopped by the simulation's checks, not the cause
    consequence: bool = False


class Returned(typing.NamedTuple):
    results: list  # (rank, pickled result) of every rank of one process


class Ended(typing.NamedTuple):
    error: str | None  # what the launcher raised, if it did
