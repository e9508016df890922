"""torch's random generator as each simulated core would have it after a seed.

Used only under ``tpunb.simulate``. On a TPU host every rank is a process with its own copy
of torch's CPU generator, so ``torch.manual_seed(s)`` in the function each rank runs gives
every rank the same draws: a model built after it starts with the same weights on every
core. On the simulation the ranks are threads sharing one generator: their draws would
interleave, and each core would start training from different weights.

So a rank that calls ``torch.manual_seed`` takes the generator for itself until its next
step (``torch_xla.sync``), collective or end (rank_threads.py), where a TPU program's setup
ends: the other ranks' ``manual_seed`` waits. Each rank then draws what it would draw on a
TPU. Draws in a rank that did not seed, and draws after the setup, still share the
generator: build the model before the launch or seed in the rank function, and give a
``torch.Generator`` to what draws in the training loop (as ``DistributedSampler`` has).
docs/simulation.md lists this with the other differences. A rank that holds the generator
longer than ``WAIT`` (e.g. waiting for another rank outside a collective) lets the others
go on, with a warning.
"""

import functools
import os
import threading
import warnings

from tpunb.errors import TpunbWarning
from tpunb.machine import cores

WAIT = 30.0  # seconds a rank waits for another rank's setup to finish drawing

_holders = {}  # pid -> (lock, [ordinal holding it or None])
_holders_lock = threading.Lock()


def seeding_alone(_, manual_seed):
    @functools.wraps(manual_seed)
    def seeding_alone(seed):
        if cores.in_rank():
            done_drawing()
            draw_alone()
        return manual_seed(seed)

    return seeding_alone


def draw_alone():
    """This rank takes the generator until ``done_drawing``."""
    lock, holder = _holder()
    ordinal = _ordinal()
    if holder[0] == ordinal:
        return
    if not lock.acquire(timeout=WAIT):
        warnings.warn(
            f"Simulated core {ordinal} waited {WAIT:.0f} s for core {holder[0]} to finish "
            "drawing from torch's random generator (the simulated cores share it) and goes "
            "on: their random draws (e.g. a model's initial weights) may differ. A TPU has "
            f"one generator a core. Does core {holder[0]} wait for the others outside a "
            "collective?",
            TpunbWarning,
            stacklevel=2,
        )
        return
    holder[0] = ordinal


def done_drawing():
    """This rank's setup is over: the other ranks may draw."""
    if not cores.in_rank():
        return
    lock, holder = _holder()
    if holder[0] is not None and holder[0] == _ordinal():
        holder[0] = None
        lock.release()


def _holder():
    # A lock per process: a forked launch must not inherit one held in the notebook's.
    with _holders_lock:
        return _holders.setdefault(os.getpid(), (threading.Lock(), [None]))


def _ordinal():
    import torch_xla.runtime as xr

    return xr.global_ordinal()
