"""Where a simulated step's time goes: the workload of benchmarks/simulation.py (an MLP
64-512-512-10, per-core batch 32 on 8 simulated cores), one epoch timed after a first
that compiles, with timers around each part of a rank-step:

- the rank's own Python: forward, backward and the optimizer's update traced into the
  lazy graph (the training loop's lines, tpunb's hooks left out);
- torch_xla's step markers (``_xla_step_marker``: the graph's hash, the compile-cache
  lookup and the dispatch of its execution), the simulation's dispatch lock (waiting for
  it and holding it) and its barriers (waiting for the other ranks);
- tpunb's per-step hooks (the step records, the batch records, the watchdog heartbeat);
- CPU time: of each rank's thread (``time.thread_time``: tracing, hashing, dispatch) and
  of the whole process (the rank threads plus XLA's execution threads), against wall time.

A rank-step's share of the epoch is the epoch's wall time over all ranks' steps; a part's
share is its time summed over the ranks' threads over the same count (parts that overlap
in time add up to more than the wall time). Timers cost about a microsecond a call.
Run: python benchmarks/simulation_profile.py [--batch N] [--cores N] (taskset -c 0 first:
one CPU, as on Binder).
"""

import argparse
import collections
import copy
import functools
import os
import resource
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulation import MODEL, _step  # noqa: E402
from workload import BATCH, DATASET  # noqa: E402

_totals = collections.defaultdict(float)  # part -> wall seconds, summed over threads
_cpu = collections.defaultdict(float)  # part -> CPU seconds of the threads in it
_counts = collections.Counter()
_lock = threading.Lock()
_timing = [False]


def _add(part, seconds, cpu=0.0):
    if _timing[0]:
        with _lock:
            _totals[part] += seconds
            _cpu[part] += cpu
            _counts[part] += 1


def _timed(part, function):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            _add(part, time.perf_counter() - start, time.thread_time() - cpu)

    return timed


class _TimedLock:
    """The dispatch lock, timed: waiting for it, and holding it."""

    def __init__(self, lock):
        self._lock = lock
        self._held = threading.local()

    def __enter__(self):
        start = time.perf_counter()
        self._lock.acquire()
        self._held.since = time.perf_counter()
        _add("dispatch lock: waiting", self._held.since - start)

    def __exit__(self, *exc):
        _add("dispatch lock: held", time.perf_counter() - self._held.since)
        self._lock.release()


def _instrument():
    """Timers around the simulation's and tpunb's parts (this benchmark's process only)."""
    import torch_xla

    from tpunb.launcher import heartbeat, recorder
    from tpunb.simulation import collectives

    torch_xla._XLAC._xla_step_marker = _timed(
        "torch_xla step markers (hash, cache, dispatch)", torch_xla._XLAC._xla_step_marker
    )
    collectives._dispatch_lock = _TimedLock(collectives._dispatch_lock)
    import torch_xla.core.xla_model as xm

    xm.optimizer_step = _timed(
        "xm.optimizer_step: the all-reduce and the update", xm.optimizer_step
    )
    for name, part in (
        ("_describe", "the simulation: describing the call (for a mismatch)"),
        ("_run_pending_work", "the simulation: cut before (the rank's pending graph)"),
        ("_run_together", "the simulation: the collective's graph, all ranks"),
    ):
        setattr(collectives, name, _timed(part, getattr(collectives, name)))
    collectives._Round.wait = _timed(
        "barriers: waiting for the other ranks", collectives._Round.wait
    )
    recorder.Recorder.end_step = _timed("tpunb: step records", recorder.Recorder.end_step)
    recorder.Recorder.batch = _timed("tpunb: batch records", recorder.Recorder.batch)
    heartbeat.tick = _timed("tpunb: heartbeat", heartbeat.tick)


def _profiled_epochs(rank, loader, cores, all_reduce=True):
    import torch_xla
    import torch_xla.core.xla_model as xm

    import tpunb

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = tpunb.shard(loader)
    thread_cpu = 0.0
    for epoch in range(2):
        xm.rendezvous(f"epoch {epoch}")
        if epoch == 1 and rank == 0:
            _timing[0] = True
            _process[:] = [time.perf_counter(), _cpu_seconds(), _threads_cpu(), _xla_metrics()]
        thread_start = time.thread_time()
        for inputs, labels in batches:
            start, cpu = time.perf_counter(), time.thread_time()
            _step(model, optimizer, inputs, labels)
            _add(
                "the rank's own Python: forward, backward",
                time.perf_counter() - start,
                time.thread_time() - cpu,
            )
            if all_reduce:
                xm.optimizer_step(optimizer)  # the all-reduce, then the update (traced)
            else:  # the ablation: each rank trains alone, no collective
                optimizer.step()
        xm.wait_device_ops()
        thread_cpu = time.thread_time() - thread_start
        xm.rendezvous(f"epoch {epoch} done")
        if epoch == 1 and rank == 0:
            _timing[0] = False
            threads = _threads_cpu()
            threads.subtract(_process[2])
            threads = _by_thread_kind(threads)
            metrics = {
                name: (
                    count - _process[3].get(name, (0, 0))[0],
                    total - _process[3].get(name, (0, 0))[1],
                )
                for name, (count, total) in _xla_metrics().items()
            }
            _process[:] = [
                time.perf_counter() - _process[0],
                _cpu_seconds() - _process[1],
                threads,
                metrics,
            ]
    return (
        thread_cpu,
        len(loader) // cores,
        list(_process),
        dict(_totals),
        dict(_counts),
        dict(_cpu),
    )


_process = []


def _xla_metrics():
    """torch_xla's timing metrics of this process: {name: (calls, seconds in all)}."""
    import torch_xla.debug.metrics as met

    found = {}
    for name in met.metric_names():
        data = met.metric_data(name)
        if data and name.endswith(("Time", "Wait", "Tracing")):
            found[name] = (data[0], data[1] / 1e9)
    return found


def _threads_cpu():
    """{thread id: CPU seconds} of this process's threads, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        found[int(tid)] += (int(fields[11]) + int(fields[12])) / ticks
    return found


def _by_thread_kind(cpu):
    """{kind: CPU seconds}: Python threads by their name (digits left out), the others
    (XLA's and PJRT's thread pools, started in C++) together."""
    names = {t.native_id: t.name.rstrip("0123456789-_ ") for t in threading.enumerate()}
    kinds = collections.Counter()
    for tid, seconds in cpu.items():
        kinds[f"Python thread {names[tid]!r}" if tid in names else "C++ threads (XLA, PJRT)"] += (
            seconds
        )
    return kinds


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serial(batch, cores):
    """The same rank-steps one after another on one XLA CPU device, no collective (the
    baseline of benchmarks/simulation.py): the CPU time that XLA's execution of these
    steps takes without any simulation."""
    import torch_xla.core.xla_model as xm
    from simulation import CORES, serial_epoch

    if cores != CORES:
        raise SystemExit(f"--serial runs the benchmark's {CORES} ranks: leave --cores out")
    run_epoch = serial_epoch(batch)

    def epoch():
        run_epoch()
        xm.wait_device_ops()

    epoch()  # compiles
    start, cpu, main_cpu = time.perf_counter(), _cpu_seconds(), time.thread_time()
    metrics = _xla_metrics()
    epoch()
    metrics = {
        name: (count - metrics.get(name, (0, 0))[0], total - metrics.get(name, (0, 0))[1])
        for name, (count, total) in _xla_metrics().items()
    }
    wall, cpu, main_cpu = (
        time.perf_counter() - start,
        _cpu_seconds() - cpu,
        time.thread_time() - main_cpu,
    )
    rank_steps = len(DATASET) // (batch * cores) * cores
    ms = 1000 / rank_steps
    print(
        f"serial rank-steps on one XLA device, batch {batch}, {len(os.sched_getaffinity(0))} "
        f"CPU(s): an epoch of {rank_steps} rank-steps took {wall:.3f} s, {wall * ms:.2f} ms a "
        f"rank-step"
    )
    print(
        f"CPU time: the whole process {cpu:.2f} s ({cpu / wall:.2f} CPUs busy), the main "
        f"thread {main_cpu:.2f} s ({main_cpu * ms:.2f} ms a rank-step), other threads (XLA's "
        f"execution) {cpu - main_cpu:.2f} s ({(cpu - main_cpu) * ms:.2f} ms a rank-step)"
    )
    print("torch_xla's own metrics, ms a rank-step (calls a rank-step):")
    for name, (count, seconds) in sorted(metrics.items(), key=lambda item: -item[1][1]):
        if count:
            print(f"  {seconds * ms:7.3f}  {name} ({count / rank_steps:.1f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=BATCH, help="per-core batch size")
    parser.add_argument("--cores", type=int, default=8, help="simulated cores")
    parser.add_argument(
        "--no-all-reduce",
        action="store_true",
        help="the ablation: each rank trains alone (optimizer.step(), no collective)",
    )
    parser.add_argument(
        "--serial", action="store_true", help="the serial rank-steps on one XLA CPU device"
    )
    options = parser.parse_args()
    if options.serial:
        _serial(options.batch, options.cores)
        return
    import tpunb

    tpunb.simulate(cores=options.cores)
    _instrument()
    loader = DataLoader(DATASET, batch_size=options.batch, drop_last=True)
    all_reduce = not options.no_all_reduce
    results = tpunb.launch(_profiled_epochs, loader, options.cores, all_reduce, live=False)
    thread_cpu = sum(r[0] for r in results)
    steps = results[0][1]
    wall, process_cpu, threads, metrics = results[0][2]
    totals, counts, cpu = results[0][3], results[0][4], results[0][5]
    rank_steps = steps * options.cores
    ms = 1000 / rank_steps
    print(
        f"{options.cores} simulated cores, per-core batch {options.batch}"
        f"{'' if all_reduce else ', no all-reduce'}, "
        f"{len(os.sched_getaffinity(0))} CPU(s): an epoch of {steps} steps "
        f"({rank_steps} rank-steps) took {wall:.3f} s, {wall * ms:.2f} ms a rank-step"
    )
    print(
        f"CPU time: the whole process {process_cpu:.2f} s ({process_cpu / wall:.2f} CPUs busy), "
        f"the rank threads {thread_cpu:.2f} s ({thread_cpu * ms:.2f} ms a rank-step), "
        f"other threads (XLA's execution, loaders) {process_cpu - thread_cpu:.2f} s"
    )
    print("CPU ms a rank-step by thread (from /proc):")
    for name, seconds in sorted(threads.items(), key=lambda item: -item[1]):
        if seconds > 0:
            print(f"  {seconds * ms:7.3f}  {name}")
    print("torch_xla's own metrics, ms a rank-step (calls a rank-step):")
    for name, (count, seconds) in sorted(metrics.items(), key=lambda item: -item[1][1]):
        if count:
            print(f"  {seconds * ms:7.3f}  {name} ({count / rank_steps:.1f})")
    print("ms a rank-step, summed over the threads: wall (waits included), CPU of the thread")
    for part, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(
            f"  {seconds * ms:7.3f} {cpu[part] * ms:7.3f}  {part} "
            f"({counts[part] / rank_steps:.1f} calls a rank-step)"
        )


if __name__ == "__main__":
    main()
