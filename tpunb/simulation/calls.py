"""The simulation's collective calls in words: where the program made one,
and the errors that name calls (``CollectiveMismatch``, ``RankEnded``)."""

import time

from tpunb.errors import CollectiveMismatch, RankEnded
from tpunb.wording import program_lines

# At a collective that can never complete (the ranks' calls differ, or a rank it needs has
# ended) a simulated rank raises at once. With this False it waits as a TPU's would, until
# the launch stops it: for testing what must work where ranks really block (the launch's
# ledger of collective calls, launcher/ledger.py).
STOP_UNMATCHED = True


def unmatched(error):
    """``error``, for the rank to raise; with ``STOP_UNMATCHED`` False, never returns."""
    while not STOP_UNMATCHED:
        time.sleep(60)
    return error


class Caller:
    """Where the program called the collective, in words only when a message needs it: the
    innermost frame outside torch, torch_xla and tpunb, and the function it called there
    (e.g. xm.all_gather). Reading the stack at every call would slow every step."""

    def __init__(self, frame):
        self.frame = frame
        self.words = "called from a place no longer known"

    def settle(self):
        """Keeps the place in words: the frame is let go once the call is over."""
        frame = self.frame
        if frame is not None:
            self.words = self._describe(frame)

    def __str__(self):
        frame = self.frame
        return self.words if frame is None else self._describe(frame)

    @staticmethod
    def _describe(frame):
        frame, entry = program_lines.program_frame(frame, program_lines.libraries())
        if frame is None:
            return "called inside torch_xla"
        code = frame.f_code
        where = f"called from {code.co_filename}, line {frame.f_lineno}, in {code.co_name}"
        return f"(in {entry}), {where}" if entry else where


def mismatch(number, calls):
    """The ``CollectiveMismatch`` for collective ``number``, where ``calls`` holds each
    rank's (step, call, caller), and some calls differ from rank 0's."""
    first = calls[0][1]
    odd = [rank for rank, (_, call, _) in enumerate(calls) if call != first]
    lines = [
        f"rank {rank}, step {calls[rank][0]}: {calls[rank][1]} {calls[rank][2]}"
        for rank in [0, *odd]
    ]
    return CollectiveMismatch(
        f"The ranks made different calls as their collective number {number}, so they "
        "cannot meet (on a TPU they would wait for each other forever):\n  "
        + "\n  ".join(lines)
        + "\nEvery rank must make the same collective calls in the same order, with tensors of "
        "the same shape and dtype (e.g. drop_last=True on the DataLoader, or pad the last "
        "batch)."
    )


def never_completes(call, caller, number, step, gone, how, cause):
    """The ``RankEnded`` of a rank whose collective waits for rank ``gone``, which has ended
    (``how``: "returned", "raised ..."; ``cause`` its exception, if known)."""
    return RankEnded(
        f"{call} {caller} (collective number {number}, step {step}) can never complete: rank "
        f"{gone} has ended (it {how}). A collective needs every rank; on a TPU the others "
        f"would wait for rank {gone} forever.",
        cause,
    )
