"""A launch process whose ranks are threads (all of them on the simulation, two a process
on TPU v2 and v3 hosts) is made ready for them before they start: two races between its
ranks, each of which killed launches, are taken out.

1. torch_xla's CPU-fallback counters. torch_xla counts the ops that fall back to the CPU in
   a map from op name to counter that has no lock (``_fallback_counters`` in
   ``xla_fallback``, https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/aten_cpu_fallback.cpp).
   An op's first fallback in a process inserts its counter; two threads inserting at once
   corrupt the map and the process dies with SIGSEGV in ``torch_xla::xla_fallback``. Ranks
   fall back together: every rank of ``xm.rendezvous``, and so of each of PyTorch
   Lightning's barriers, calls ``.item()`` at the same moment. On 8 simulated cores about 1
   launch in 200 of 50 rendezvous each died so (docs/simulation.md). Once a counter exists
   the threads only read the map, which is safe: the process runs the fallbacks training
   code meets most once, on device data (nothing is compiled), then puts torch_xla's
   counters and metrics back as they were: a counter at 0 stays in the map but is shown
   nowhere (``GetFallbackOperations``, ``GetCounterNames``), so the ranks' programs read
   no transfer or fallback they did not make.

2. Forks. A rank whose DataLoader has worker processes forks them from its thread, and the
   ranks do so at the same moment (each epoch's first batch). On Python 3.12+ filelock
   (imported by torch) refuses a fork while another thread's fork is under way: its audit
   hook, which runs before any fork, raises "RuntimeError: os.fork is unsafe while
   filelock is changing descriptor ownership" (``_audit_fork_safety`` in filelock/_api.py,
   filelock 4.2). The process's ``os.fork`` takes a lock, so its ranks' forks follow each
   other.
"""

import functools
import threading

from tpunb.machine import cores
from tpunb.upstream import registry

# The ops whose first fallback is created up front: .item() / float(t) / a Python if on a
# tensor, boolean masks and masked_select.
PRIMED_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")

_fork_lock = threading.Lock()


def install():
    """Makes every ``xmp.spawn`` process with more than one rank get ready as above before
    its rank threads start. Stays installed: it does nothing where a process runs one rank."""
    registry.install("shared process")


def then_prepare(_, initialize):
    # Keeps initialize's name: xmp.spawn pickles it by name to send it to the processes.
    @functools.wraps(initialize)
    def initialize_then_prepare(local_rank, local_world_size):
        initialize(local_rank, local_world_size)
        if cores.ranks_in_this_process() > 1:
            create_counters()
            registry.install("forks one at a time")

    return initialize_then_prepare


def create_counters():
    """Runs each op of ``PRIMED_OPS`` once on this process's first device, then sets
    torch_xla's counters and metrics back to what they were."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    counters = {name: met.counter_value(name) for name in met.counter_names()}
    device = torch_xla.device()
    values = torch.tensor([1.0, 0.0]).to(device)  # device data: nothing to compile
    mask = torch.tensor([True, False]).to(device)
    torch.tensor([1.0]).to(device).item()
    torch.nonzero(values)
    values.masked_select(mask)
    del values, mask
    # The runtime has just started here: the metrics (timings) all come from the lines above.
    met.clear_metrics()
    met.clear_counters()
    for name, value in counters.items():
        torch_xla._XLAC._xla_increment_counter(name, value)


def one_at_a_time(_, fork):
    """This process's ``os.fork`` (which multiprocessing calls) waits for any fork another
    of its threads has under way."""

    @functools.wraps(fork)
    def fork_one_at_a_time():
        with _fork_lock:  # the child's copy is released as it leaves this block too
            return fork()

    return fork_one_at_a_time
