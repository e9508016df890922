"""A simulated process's rank threads on one CPU, where the machine has two.

The ranks of a process are threads that take turns with the GIL. On two CPUs each handoff
wakes a thread on the other CPU: a quarter of the process's time went to the kernel's
scheduler (futex waits and wakes, the GIL's mutex, reschedule interrupts) against a
twentieth on one CPU, and a small model trained faster under ``taskset -c 0`` than on both
CPUs. So, at its first sync after the process's first execution, each rank thread of a
process that runs several moves to the first CPU the process may use: Python runs one thread
at a time anyway, while the threads that XLA, torch_xla and autograd have started by then
(executions, the intra-op pool, the backward passes) keep every CPU. Measured on 2 CPUs in
``benchmarks/simulation_variants.py`` (in git at e37ef2a: "as shipped" against "rank threads on
every CPU");
docs/simulation.md, "The rank threads on one CPU". With more CPUs, where it is unmeasured,
nothing changes.

What a confined rank thread starts inherits its CPU: threads, which is what Python's are for
here, and processes. Those it forks get the process's CPUs back as they start (a
``DataLoader``'s workers, a rank's own ``multiprocessing``); those started with exec
(``subprocess``, the spawn start method) keep the one CPU.
"""

import os
import threading

# The CPUs a process may use for its rank threads to be moved to one of them: measured on 2.
CONFINED_ON = 2
# In a rank thread: whether it was placed yet and, if it moved, the CPUs it had before.
_thread = threading.local()
_fork_hook = []  # registered once a process (simulate may run again)
_autograd_starting = threading.Lock()


def rank_started():
    """Called first in a rank thread (not in the threads it or torch_xla start, which may
    sync too: autograd's, where DDP's hooks run)."""
    _thread.placed = False


def after_sync():
    """Called in a rank thread after each of its syncs: moves the thread at the first one
    after the process's first execution. Threads inherit the CPUs of the thread that starts
    them: by then torch_xla's execution threads have started on every CPU, and autograd's
    are started before the thread moves."""
    if getattr(_thread, "placed", True):
        return
    import torch_xla.debug.metrics as met

    if not met.metric_data("ExecuteTime"):
        return
    _thread.placed = True
    from tpunb.machine import cores

    cpus = os.sched_getaffinity(0)  # on Linux, of the calling thread
    if len(cpus) == CONFINED_ON and cores.ranks_in_this_process() > 1:
        _start_autograds_threads()
        os.sched_setaffinity(0, {min(cpus)})
        _thread.cpus = cpus


def _start_autograds_threads():
    """Autograd starts its threads, one a device, at the process's first backward pass of
    any tensor (``Engine::initialize_device_threads_pool`` in torch's
    torch/csrc/autograd/engine.cpp). A rank's first may come after another rank moved: one
    of a CPU number here starts them on every CPU first (and does nothing once they run).
    One rank at a time: the ranks leave a collective together, and several first backward
    passes at once, each starting the threads, crashed a launch process (SIGSEGV in
    ``strlen`` under ``_engine_run_backward``, once in a CI run)."""
    import torch

    # The sync may run under no_grad or inference_mode (an evaluation, dynamo's extraction).
    with _autograd_starting, torch.inference_mode(False), torch.enable_grad():
        (torch.ones((), requires_grad=True) * 1).backward()


def install():
    """A process forked by a confined rank thread gets the CPUs the thread had."""
    if not _fork_hook:
        os.register_at_fork(after_in_child=_child_gets_the_cpus_back)
        _fork_hook.append(_child_gets_the_cpus_back)


def _child_gets_the_cpus_back():
    cpus = getattr(_thread, "cpus", None)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
        _thread.cpus = None
