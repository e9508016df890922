"""Each launch process creates torch_xla's CPU-fallback counters before its rank threads
start, so that threads falling back together cannot crash it.

torch_xla counts the ops that fall back to the CPU in a map from op name to counter that
has no lock (``_fallback_counters`` in ``xla_fallback``, torch_xla/csrc/aten_cpu_fallback.cpp,
https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/aten_cpu_fallback.cpp). An op's
first fallback in a process inserts its counter; two threads inserting at once corrupt the
map and the process dies with SIGSEGV in ``torch_xla::xla_fallback``. Where the ranks are
threads of one process (2 a process on TPU v2 and v3 hosts, all of them on the
simulation) they fall back together: every rank of ``xm.rendezvous``, and so of each of
PyTorch Lightning's barriers, calls ``.item()`` at the same moment. On 8 simulated cores
about 1 launch in 200 of 50 rendezvous each died so (docs/simulation.md).

Once a counter exists the threads only read the map, which is safe. So the process runs
the fallbacks training code meets most (the ones the compile watch explains) once, on
device data: no graph is compiled, and tpunb's per-step counts start after them.
"""

import functools

from tpunb import cores

# The ops whose first fallback is created up front: .item() / float(t) / a Python if on a
# tensor, boolean masks and masked_select.
PRIMED_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")


def install():
    """Makes every multi-threaded ``xmp.spawn`` process create the counters first. Stays
    installed: it only adds these three fallbacks, once a process, where ranks are threads."""
    import torch_xla._internal.pjrt as pjrt

    if not getattr(pjrt.initialize_multiprocess, "creates_fallback_counters", False):
        pjrt.initialize_multiprocess = _then_create_counters(pjrt.initialize_multiprocess)


def _then_create_counters(initialize):
    # Keeps initialize's name: xmp.spawn pickles it by name to send it to the processes.
    @functools.wraps(initialize)
    def initialize_then_create_counters(local_rank, local_world_size):
        initialize(local_rank, local_world_size)
        create_counters()

    initialize_then_create_counters.creates_fallback_counters = True
    return initialize_then_create_counters


def create_counters():
    """Runs each op of ``PRIMED_OPS`` once on this process's first device, if the process
    runs more than one rank. Called before the rank threads start."""
    import torch
    import torch_xla

    if cores.ranks_in_this_process() < 2:
        return
    device = torch_xla.device()
    values = torch.tensor([1.0, 0.0]).to(device)  # device data: nothing to compile
    mask = torch.tensor([True, False]).to(device)
    torch.tensor([1.0]).to(device).item()
    torch.nonzero(values)
    values.masked_select(mask)
