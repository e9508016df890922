"""On a machine of two CPUs, a simulated process's rank threads share one CPU from their
first sync after the process's first execution; the threads that XLA, torch_xla and
autograd started keep both, and a process that a rank forks gets both back
(tpunb/simulation/rank_cpu.py)."""

import contextlib
import multiprocessing
import os
import threading

import pytest

import tpunb

TWO_CPUS = sorted(os.sched_getaffinity(0))[:2]
pytestmark = pytest.mark.skipif(len(TWO_CPUS) < 2, reason="needs 2 CPUs")


@contextlib.contextmanager
def _on_two_cpus():
    """This process (and so the ranks' process it forks) on two CPUs, as on Colab's CPU
    runtime, whatever this machine has."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, TWO_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def _put_cpus(queue):
    queue.put(sorted(os.sched_getaffinity(0)))


def _cpus_of_a_forked_child():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_put_cpus, args=(queue,))
    child.start()
    cpus = queue.get(timeout=60)
    child.join()
    return cpus


def _placements(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    before = sorted(os.sched_getaffinity(0))  # of this thread
    model = torch.nn.Linear(4, 1).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4, device=torch_xla.device())
    torch_xla.sync()  # nothing to run yet, as at a loader's first batch
    for _ in range(3):
        optimizer.zero_grad()
        model(x).sum().backward()  # the first starts autograd's threads, one a device
        optimizer.step()
        torch_xla.sync()
    xm.wait_device_ops()  # the process has executed a graph
    torch_xla.sync()
    after = sorted(os.sched_getaffinity(0))
    if rank != 0:
        return before, after
    python_threads = {thread.native_id for thread in threading.enumerate()}
    others = []
    for task in os.listdir("/proc/self/task"):
        if int(task) not in python_threads:
            with contextlib.suppress(OSError):  # the thread has ended
                others.append(sorted(os.sched_getaffinity(int(task))))
    return before, after, _cpus_of_a_forked_child(), others


def test_the_rank_threads_share_one_cpu_and_what_they_fork_gets_both_back(cores8_threads):
    with _on_two_cpus():
        results = tpunb.launch(_placements, live=False)
        assert sorted(os.sched_getaffinity(0)) == TWO_CPUS  # the notebook's own: unchanged
    for before, after, *_ in results:
        assert before == TWO_CPUS
        assert after == TWO_CPUS[:1]
    _, _, forked, others = results[0]
    assert forked == TWO_CPUS
    # XLA's, torch_xla's and autograd's threads (one a device): started before any rank
    # thread moved, they keep both CPUs.
    assert len(others) >= 16 + 8
    assert all(cpus == TWO_CPUS for cpus in others), others


def _evaluation(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = torch.nn.Linear(4, 1).to(torch_xla.device())
    with torch.no_grad():
        sums = []
        for _ in range(3):
            sums.append(model(torch.ones(2, 4, device=torch_xla.device())).sum())
            torch_xla.sync()
        xm.wait_device_ops()
        torch_xla.sync()
    return sorted(os.sched_getaffinity(0))


def test_ranks_that_only_evaluate_under_no_grad_move_too(cores8_threads):
    with _on_two_cpus():
        results = tpunb.launch(_evaluation, live=False)
    assert results == [TWO_CPUS[:1]] * 8


def test_a_process_of_one_rank_keeps_both_cpus(cores8_threads):
    with _on_two_cpus():
        results = tpunb.launch(_placements, cores=1, live=False)
    before, after, _, _ = results[0]
    assert before == after == TWO_CPUS
