"""Collectives between simulated CPU devices: a ``torch_xla.sync`` that lets them finish.

Used only under ``tpunb.simulate`` (never on a TPU). Upstream, collectives between
threads on PJRT CPU devices hang (https://github.com/pytorch/xla/issues/5005,
https://github.com/pytorch/xla/issues/9089). docs/simulation.md has the
measurements; in short, four things must hold for a step that contains a collective:

1. torch_xla's thread pool has a thread for every replica (``XLA_THREAD_POOL_SIZE``,
   set by ``simulate``), or the replicas beyond the pool size never arrive.
2. Only one replica compiles the step graph; the others must hit the compilation cache.
   Each compilation gets its own HLO module id, which the CPU runtime uses as the
   rendezvous key of the all-reduce, so concurrent first compiles wait in different
   rendezvous forever. Hence the dispatch lock below.
3. No replica waits for another while holding the GIL. After dispatch, ``sync`` releases
   the all-reduce token, which can block on a buffer still used by the pending
   all-reduce without releasing the GIL. So every replica first waits on a
   ``threading.Barrier`` (which releases the GIL) until all have dispatched.

4. The graph holding the collective is the same on every rank. Ranks whose step differs
   before the collective (batches of different shapes, rank-dependent Python numbers) would
   compile different modules, hence different rendezvous. So the work traced before a
   rank's first collective runs first, as a graph of its own (``_run_pending_work``); the
   collective's graph then starts from device data. That cut is dispatched under the
   dispatch lock too: without it, 1 run in 2 of a batch-size sweep aborted in rendezvous.

5. No rank dispatches the collective while another is still in the Python work before
   it. A rank whose collective runs holds a thread in the rendezvous, and another rank's
   blocking call (seen after ``model.to(device)`` in PyTorch Lightning's setup) could
   then wait for it without releasing the GIL: the other ranks never arrive. So the
   ranks also meet on the barrier before dispatching.

Plus the synchronous PJRT CPU client (``PJRT_CPU_ASYNC_CLIENT=false``, set by
``simulate``): with the asynchronous one, Adam's step still deadlocked in buffer release.

Syncs whose graph has no collective take neither lock nor barrier, so work done by one
rank alone (printing, evaluation on rank 0) behaves as upstream.
"""

import functools
import os
import threading

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
import torch_xla.torch_xla as torch_xla_module
import torch_xla.utils.utils as xu

# The primitives every Python collective (xm.*, torch.distributed's XLA backend)
# reaches, with xm.all_reduce below. torch_xla keeps an all-reduce token per device that
# is never None from Python, so the sync below learns that a graph holds a collective
# from these wrappers instead.
COLLECTIVE_PRIMITIVES = (
    "_xla_all_reduce",
    "_xla_all_reduce_inplace",
    "_xla_all_gather",
    "_xla_all_gather_out",
    "_xla_all_gather_coalesced",
    "_xla_all_gather_coalesced_out",
    "_xla_reduce_scatter",
    "_xla_reduce_scatter_out",
    "_xla_reduce_scatter_coalesced",
    "_xla_reduce_scatter_coalesced_out",
    "_xla_all_to_all",
    "_xla_collective_permute",
    "_xla_send",
    "_xla_recv",
)

_upstream_sync = torch_xla_module.sync
_pending = threading.local()  # per rank: does the graph being built hold a collective?
_dispatch_lock = threading.Lock()
_barriers = {}
_barriers_lock = threading.Lock()


def install():
    """Route every ``torch_xla.sync`` (and so MpDeviceLoader, ``xm.optimizer_step(barrier=True)``,
    ``xm.rendezvous``, ``xm.mesh_reduce`` and ``torch_xla.compile``) through ``sync``."""
    if torch_xla.sync is sync:
        return
    for name in COLLECTIVE_PRIMITIVES:
        setattr(torch_xla._XLAC, name, _marking(getattr(torch_xla._XLAC, name)))
    # xm.all_reduce's default path is the C++ op torch.ops._c10d_functional.all_reduce.
    xm.all_reduce = _marking(xm.all_reduce)
    xm._all_gather_using_all_reduce = _all_gather_using_all_reduce
    xm.collective_broadcast = _synced(xm.collective_broadcast)
    torch_xla.sync = sync
    # torch_xla.compile calls the module-level name, not the package attribute.
    torch_xla_module.sync = sync


def sync(wait=False, reset_scope=True):
    """``torch_xla.sync`` that completes collectives between threads on simulated cores."""
    if not getattr(_pending, "collective", False):
        return _upstream_sync(wait=wait, reset_scope=reset_scope)
    _pending.collective = False
    device = torch_xla._XLAC._xla_get_default_device()
    barrier = _barrier()
    barrier.wait()  # point 5 above: every rank is here before any dispatches
    with _dispatch_lock:
        torch_xla._XLAC._xla_step_marker(device, [], wait=False, reset_scope=reset_scope)
    barrier.wait()
    if xu.getenv_as("XLA_SYNC_WAIT", bool, wait):
        xm.wait_device_ops()
    # The rest of upstream torch_xla.sync, in its order.
    if xm.is_master_ordinal():
        xm.ms.save_metrics()
    devctx = xm._run_step_closures()
    torch_xla._XLAC._set_all_reduce_token(devctx.device, None)


def _marking(primitive):
    @functools.wraps(primitive)
    def marked(*args, **kwargs):
        if not getattr(_pending, "collective", False):
            _run_pending_work()
            _pending.collective = True
        return primitive(*args, **kwargs)

    return marked


def _run_pending_work():
    """Runs what this rank has traced so far, before its first collective of the step.

    See point 4 above. On a TPU each rank compiles its own step graph and the collectives
    still meet; this cut lets the simulation do the same. A step then runs as two graphs,
    each compiled once per distinct input.
    """
    with _dispatch_lock:
        torch_xla._XLAC._xla_step_marker(
            torch_xla._XLAC._xla_get_default_device(), [], wait=False, reset_scope=True
        )


def _synced(collective):
    """A collective followed by ``sync``, for the callers that read its result at once.

    PyTorch Lightning's ``XLAStrategy.broadcast`` (used for the log directory before
    training) reads the broadcast tensor with ``.cpu()`` right after
    ``xm.collective_broadcast``. That read executes the graph from C++, outside ``sync``
    above: the ranks compile it concurrently, each under its own module id, and the
    all-reduce waits for ranks that never come (see "Limits" in docs/simulation.md). Ending
    the step inside the broadcast gives the same values, computed through ``sync``.
    """

    @functools.wraps(collective)
    def synced(*args, **kwargs):
        result = collective(*args, **kwargs)
        sync()
        return result

    return synced


def _all_gather_using_all_reduce(value, dim=0, groups=None, pin_layout=True):
    """``xm.all_gather``'s default path with one graph for every rank.

    Upstream pads the value by the rank's ordinal, a constant baked into the graph, so
    every rank compiles its own module; on the CPU each module is its own rendezvous and
    the all-reduce never completes. Here the rank's slot is chosen by a mask sent as
    device data: the same graph everywhere, the same result.
    """
    if dim < 0:
        dim = value.dim() + dim
    ordinal = xr.global_ordinal()
    group = next((g for g in groups if ordinal in g), None) if groups else None
    slots = len(group) if group else xr.world_size()
    mask = torch.zeros(slots, dtype=torch.bool)
    mask[group.index(ordinal) if group else ordinal] = True
    mask = xm.send_cpu_data_to_device(mask, value.device)[0]
    shape = [1] * (value.dim() + 1)
    shape[dim] = slots
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    spread = torch.where(mask.view(shape), value.unsqueeze(dim), zero)
    gathered = xm.all_reduce(xm.REDUCE_SUM, spread, groups=groups, pin_layout=pin_layout)
    return gathered.flatten(dim, dim + 1)


def _barrier():
    # One barrier per process and replica count: a forked child must not inherit a
    # barrier another launch has used. On the CPU all replicas are threads of one process.
    key = (os.getpid(), xr.world_size())
    with _barriers_lock:
        if key not in _barriers:
            _barriers[key] = threading.Barrier(key[1])
        return _barriers[key]
