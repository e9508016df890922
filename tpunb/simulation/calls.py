"""A collective call in words, for both layouts: what it is (its name, its tensors' shapes
and dtypes, its other arguments), where the program made it, and the errors that name
calls (``CollectiveMismatch``, ``RankEnded``)."""

import os
import sys
import traceback

import torch

from tpunb.errors import RankEnded, TpunbError


class CollectiveMismatch(TpunbError):
    """Ranks called different collectives at the same point, so they can never meet."""


def describe(name, args, kwargs):
    """A collective call in words: its name, its tensors' shapes and dtypes, and its other
    arguments (reduce type, groups, scale)."""
    parts = [_value(arg) for arg in args]
    parts += [f"{key}={_value(value)}" for key, value in sorted(kwargs.items())]
    return f"{name.lstrip('_').replace('xla_', '', 1)}({', '.join(parts)})"


def _value(value):
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return repr(list(value))
    return type(value).__name__


class Caller:
    """Where the program called the collective, in words only when a message needs it: the
    innermost frame outside torch, torch_xla and tpunb, and the function it called there
    (e.g. xm.all_gather). Reading the stack at every call would slow every step."""

    def __init__(self, frame):
        self.frame = frame

    def __str__(self):
        import torch_xla

        libraries = tuple(
            os.path.dirname(module.__file__) + os.sep
            for module in (torch, torch_xla, sys.modules["tpunb"])
        )
        entry = None
        for frame, _ in traceback.walk_stack(self.frame):
            code = frame.f_code
            if code.co_filename.startswith(libraries) or "/threading.py" in code.co_filename:
                if code.co_filename.startswith(libraries[1]):  # torch_xla's own function
                    entry = code.co_name
                continue
            where = f"called from {code.co_filename}, line {frame.f_lineno}, in {code.co_name}"
            return f"(in {entry}), {where}" if entry else where
        return "called inside torch_xla"


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
