"""The errors tpunb raises: one class for the package, one for failures inside a rank, two
for simulated ranks whose collectives can never complete, and one warning class with the
one way tpunb warns; the one check of a count that every call uses; and the current
spellings of older tutorials' calls.

Pasted tutorials fail with errors that do not say what replaced the call (torch_xla has
removed ``xm.xrt_world_size``, ``xm.get_ordinal`` and ``xm.xrt_device_count``: 2.8 has none
of them; Lightning 2.0 removed ``Trainer(tpu_cores=...)``). Where tpunb sees such an error
or argument, it adds the fix (``hint_for_error``, ``trainer_argument_error``)."""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

from tpunb import program_lines

if TYPE_CHECKING:
    from collections.abc import Iterable


class TpunbError(Exception):
    """Something would break (or broke) a launch; the message says how to fix it."""


class RankError(TpunbError):
    """A rank failed inside a launch: it raised, was killed by a signal, or sent nothing back.

    ``ranks`` lists the failing ranks; ``remote_traceback`` is the rank's own
    traceback text when it raised (None when it was killed); ``signal`` is the
    signal's name when a process was killed (None otherwise); ``stacks`` maps each rank
    still running when a hang was detected to its Python stack (empty otherwise).
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: Iterable[int],
        remote_traceback: str | None = None,
        signal: str | None = None,
        stacks: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.remote_traceback = remote_traceback
        self.signal = signal
        self.stacks = dict(stacks or {})


class RankEnded(TpunbError):
    """On simulated cores: a rank called a collective that a rank which has already ended
    can never join. ``cause`` is the exception that ended that rank, or None if it returned."""

    def __init__(self, message, cause):
        super().__init__(message)
        self.cause = cause

    def __reduce__(self):  # sent between processes (the process layout, xmp.spawn's pool)
        return type(self), (str(self), self.cause)


class CollectiveMismatch(TpunbError):
    """On simulated cores with no launch around them: the ranks took different paths to
    their collectives, so they can never meet (a launch names it on a TPU too); the message
    names each rank's call and line (watch/collective_calls.py)."""


class TpunbWarning(UserWarning):
    """Something will work, but slowly or riskily; the message says what to change."""


def warn(message: str) -> None:
    """Warns ``message`` as a ``TpunbWarning`` at the program's line that called tpunb,
    named as the notebook names it: "cell In[6]:2: TpunbWarning: ...", where Python would
    name the temporary file IPython compiled the cell into (``/tmp/ipykernel_.../....py``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "tpunb":
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, TpunbWarning, stacklevel=2)
        return
    warnings.warn_explicit(
        message,
        TpunbWarning,
        program_lines.cell_or_file(frame.f_code.co_filename),
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )


def check_count(value, call, what, example):
    """``value`` if it is a positive integer (not a bool), else a TpunbError naming the
    call with the value in place of ``...``, e.g. ``check_count(n, "simulate(cores=...)",
    "cores", 8)``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        written = call.replace("...", repr(value))
        raise TpunbError(
            f"{written}: give the number of {what} as a positive integer, e.g. {example}."
        )
    return value


# Removed torch_xla.core.xla_model names -> what to write instead.
XLA_MODEL_RENAMES = {
    "xrt_world_size": "torch_xla.runtime.world_size()",
    "get_ordinal": "torch_xla.runtime.global_ordinal()",
    "xrt_device_count": "torch_xla.runtime.addressable_device_count()",
}

# Removed Trainer(...) arguments -> what to write instead.
TRAINER_RENAMES = {
    "tpu_cores": 'accelerator="tpu", devices={value!r}',
    "num_tpu_cores": 'accelerator="tpu", devices={value!r}',
}

# Strategy names Lightning 1.x used for TPUs; 2.x calls the strategy "xla".
TRAINER_STRATEGY_RENAMES = {"tpu_spawn": "xla", "tpu_spawn_debug": "xla_debug", "xla_spawn": "xla"}


def hint_for_error(text):
    """The current spelling for an error message that names a removed call, or None."""
    for old, new in XLA_MODEL_RENAMES.items():
        if f"has no attribute '{old}'" in text:
            return (
                f"xm.{old}() comes from an older torch_xla tutorial; it was removed. "
                f"Write {new} instead (import torch_xla.runtime as xr)."
            )
    for old in TRAINER_RENAMES:
        if f"unexpected keyword argument '{old}'" in text:
            return _old_trainer_argument(old, "...", 8)  # the value is not in the message
    return None


def trainer_argument_error(kwargs):
    """What is wrong with old-style ``Trainer`` arguments in ``kwargs``, or None."""
    for old in TRAINER_RENAMES:
        if old in kwargs:
            return _old_trainer_argument(old, repr(kwargs[old]), kwargs[old])
    strategy = kwargs.get("strategy")
    if isinstance(strategy, str) and strategy in TRAINER_STRATEGY_RENAMES:
        return (
            f'Trainer(strategy="{strategy}") is PyTorch Lightning 1.x; Lightning 2 calls it '
            f'strategy="{TRAINER_STRATEGY_RENAMES[strategy]}" (the default for '
            'accelerator="tpu", so it can be left out).'
        )
    return None


def _old_trainer_argument(old, written, value):
    new = TRAINER_RENAMES[old].format(value=value)
    return (
        f"Trainer({old}={written}) is PyTorch Lightning 1.x; Lightning 2 spells it Trainer({new})."
    )
