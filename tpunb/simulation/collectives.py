"""Collectives between simulated CPU devices that are threads of one process (the threads
layout): each collective call a graph of its own, run by every rank together.

Used only under ``tpunb.simulate`` (never on a TPU). Upstream, collectives between threads
on PJRT CPU devices hang (https://github.com/pytorch/xla/issues/5005,
https://github.com/pytorch/xla/issues/9089): XLA's CPU runtime joins a collective's ranks
only where they run the same compiled module. So what a rank traced before a collective
runs first (``_run_pending_work``), the collective's graph runs as soon as the call returns
(``_run_together``), and ranks whose calls differ raise ``CollectiveMismatch`` at once. The
barriers, the dispatch lock and the runtime's settings this takes, each with the failure it
fixes: docs/simulation.md, "One process of N threads".
"""

import functools
import os
import sys
import threading

import torch
import torch_xla
import torch_xla.runtime as xr

from tpunb.errors import RankEnded
from tpunb.machine import cores
from tpunb.simulation import random_state, rank_cpu
from tpunb.simulation.calls import (  # noqa: F401 (CollectiveMismatch: its home for users)
    Caller,
    CollectiveMismatch,
    mismatch,
    never_completes,
    unmatched,
)
from tpunb.watch.collective_calls import describe

# xm.all_reduce's default path is the C++ op torch.ops._c10d_functional.all_reduce
# (functional_collectives.py).


_calls = threading.local()  # per thread: a collective call under way? compiles at its sync
_dispatch_lock = threading.Lock()
_rounds = {}
_rounds_lock = threading.Lock()


class _Round:
    """The ranks of one process meeting at their collectives: each rank's description of
    the call it is making, how far each rank is, which ranks have ended, and a barrier that
    lets no rank wait for one that has ended."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.calls = [None] * ranks
        self.collectives = [0] * ranks
        self.steps = [1] * ranks
        self.ended = {}  # rank -> the exception that ended it, or None if it returned
        self.gone = set()  # every rank that has ended, those stopped by an ended one too
        self._arrived = 0
        self._passes = 0  # how many times every rank has arrived
        self._condition = threading.Condition()

    def wait(self):
        """Waits until every rank arrives (True), or until one of the ranks that have not
        arrived has ended (False). Waiting releases the GIL."""
        with self._condition:
            passes = self._passes
            self._arrived += 1
            if self._arrived == self.ranks:
                self._arrived = 0
                self._passes += 1
                self._condition.notify_all()
                return True
            self._condition.wait_for(lambda: self._passes != passes or self.ended)
            if self._passes != passes:
                return True
            self._arrived -= 1
            return False

    def end(self, rank, error):
        with self._condition:
            self.gone.add(rank)
            if self.ended and isinstance(error, RankEnded):
                return  # stopped by an ended rank: the first one stays the cause
            self.ended.setdefault(rank, error)
            self._condition.notify_all()


def _step_ended(caller):
    """After a sync: counts the rank's steps, for the mismatch message."""
    if cores.in_rank():
        random_state.done_drawing()
        _round().steps[xr.global_ordinal()] += 1
        rank_cpu.after_sync()


def _compile_alone(caller):
    """Before a sync's step marker: takes the dispatch lock while the process compiles (it
    compiled since this rank's last sync). torch_xla looks a graph up, compiles it on a
    miss, then adds it to the cache (``LookupCachedCompile`` in
    https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/xla_graph_executor.cpp): ranks
    that leave a collective together and sync the same new graph would each compile it.
    Once the graphs are compiled, the ranks dispatch side by side."""
    if _compiles() != getattr(_calls, "compiles_at_sync", -1):
        _dispatch_lock.acquire()
        _calls.holding = True


def _others_may_dispatch(caller):
    """Right after the step marker: the lock taken by ``_compile_alone`` is given back."""
    if getattr(_calls, "holding", False):
        _calls.holding = False
        _dispatch_lock.release()
        _calls.compiles_at_sync = _compiles()


# The thread layout's work at each sync (registry.LAYOUTS).
STEP_HOOKS = {"before": _compile_alone, "dispatched": _others_may_dispatch, "after": _step_ended}


def _compiles():
    return torch_xla._XLAC._xla_counter_value("UncachedCompile")


def own_graph(_, collective):
    """The registry's maker: ``collective`` as a graph of its own that the ranks run
    together (points 1 and 2)."""

    @functools.wraps(collective)
    def call(*args, **kwargs):
        return _between_graphs(collective, args, kwargs)

    return call


# torch.compile runs the call as it is, between the graphs it compiles before and after:
# dynamo must not trace it into a graph of its own (torch._dynamo.disable).
@torch._dynamo.disable
def _between_graphs(collective, args, kwargs):
    if getattr(_calls, "under_way", False):
        return collective(*args, **kwargs)
    random_state.done_drawing()
    _run_pending_work()
    _calls.under_way = True
    try:
        result = collective(*args, **kwargs)
    finally:
        _calls.under_way = False
    _run_together(describe(collective.__name__, args, kwargs))
    return result


def _run_pending_work():
    """Runs what this rank has traced so far, before a collective (point 1 above)."""
    with _dispatch_lock:
        # reset_scope=False: the cut is inside the user's step, maybe inside a profiler
        # scope (xp.Trace) that must still be open when the step's own sync comes.
        torch_xla._XLAC._xla_step_marker(
            torch_xla._XLAC._xla_get_default_device(), [], wait=False, reset_scope=False
        )


def _run_together(call):
    """Runs the collective's graph on every rank at once (point 2 above), or raises
    ``CollectiveMismatch`` on every rank if their calls differ."""
    device = torch_xla._XLAC._xla_get_default_device()
    meeting = _round()
    rank = xr.global_ordinal()
    meeting.collectives[rank] += 1
    caller = Caller(sys._getframe())
    meeting.calls[rank] = (call, caller)
    try:
        _wait_for_every_rank(meeting, rank)  # every rank has described its call
        _check_same_call(meeting)
        with _dispatch_lock:
            torch_xla._XLAC._xla_step_marker(device, [], wait=False, reset_scope=False)
        _wait_for_every_rank(meeting, rank)
    except BaseException:
        caller.settle()  # another rank's error message may still name this call
        raise
    finally:
        # The caller's frames hold the program's tensors: kept, they would outlive the
        # step, and a failed step's outputs (out of memory) would fail every later sync.
        caller.frame = None
    torch_xla._XLAC._set_all_reduce_token(device, None)


def _wait_for_every_rank(meeting, rank):
    if meeting.wait():
        return
    gone, cause = next(iter(meeting.ended.items()))
    how = "returned" if cause is None else f"raised {type(cause).__name__}: {cause}"
    call, caller = meeting.calls[rank]
    number, step = meeting.collectives[rank], meeting.steps[rank]
    raise unmatched(never_completes(call, caller, number, step, gone, how, cause)) from cause


def new_meeting_place():
    """A process's ranks are starting: they meet in a new round (rank_threads.py)."""
    with _rounds_lock:
        for key in [key for key in _rounds if key[0] == os.getpid()]:
            del _rounds[key]


def rank_ended(error):
    """This rank returned (``error`` None) or raised ``error``: the ranks waiting for it at
    a collective, and those that call one later, raise ``RankEnded`` (rank_threads.py)."""
    if getattr(_calls, "holding", False):  # its step marker raised
        _calls.holding = False
        _dispatch_lock.release()
    if cores.in_rank():
        _round().end(xr.global_ordinal(), error)


def how_ended(rank):
    """None while ``rank`` of this process's launch runs; once it has ended, how ("returned",
    "raised ...", "was stopped by rank N's end") and the exception of the rank that ended
    first (None if it returned)."""
    meeting = _round()
    with meeting._condition:
        if rank not in meeting.gone:
            return None
        first, cause = next(iter(meeting.ended.items()))
        if rank not in meeting.ended:
            return f"was stopped by rank {first}'s end", cause
        error = meeting.ended[rank]
        return ("returned" if error is None else f"raised {type(error).__name__}"), cause


def _check_same_call(meeting):
    first = meeting.calls[0][0]
    if any(call != first for call, _ in meeting.calls):
        calls = [(meeting.steps[rank], *meeting.calls[rank]) for rank in range(meeting.ranks)]
        raise unmatched(mismatch(meeting.collectives[0], calls))


def _round():
    # One round per process and replica count: a forked child must not inherit one that
    # another launch has used. On the CPU all replicas are threads of one process.
    key = (os.getpid(), xr.world_size())
    with _rounds_lock:
        if key not in _rounds:
            _rounds[key] = _Round(key[1])
        return _rounds[key]
