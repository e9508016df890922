"""What the simulation's safeguards cost: the workload of benchmarks/simulation.py on 8
simulated cores, as tpunb runs it and with each safeguard taken away, in the same run.

Two baselines without threads first, which bound what the simulation can reach:

- serial, one device: the rank-steps one after another from one Python thread, on one
  XLA CPU device (benchmarks/simulation.py's serial rank-steps).
- serial, 8 devices: the same, each rank's model on its own device of an XLA runtime of
  8 CPU devices, as on simulated cores (XLA sizes its CPU client's thread pools by the
  device count).

Then 8 simulated cores:

- as shipped: tpunb.simulate as it is.
- one barrier: the ranks meet once before the collective's graph is dispatched, not again
  after it.
- no barriers: the ranks never wait for each other in Python (XLA's rendezvous is the only
  meeting).
- one graph: no cuts: the collective stays in the step's graph, as on a TPU, and the
  step's ``torch_xla.sync()`` is dispatched under the dispatch lock between two barriers.
- one Python thread: the ranks take turns to run Python (the turn is passed on at barriers
  and syncs), so that eight threads do not contend for the GIL.
- a local op: everything as shipped, but the all-reduce's primitive replaced by a local op
  on the same tensors (each rank's gradients scaled): the collective's graph, its cuts and
  barriers, without XLA's collective.
- no collective: the ablation, each rank trains alone (``optimizer.step()``).
- rank threads on every CPU: the ranks' threads stay on every CPU the process may use,
  instead of moving to one at their first sync on a 2-CPU machine
  (tpunb/simulation/rank_cpu.py).

The variants are measurements, not options: they are safe for this workload only, whose
ranks all trace the same graphs. Without the safeguards, ranks whose graphs differ abort in
XLA's rendezvous (tpunb/simulation/collectives.py says why).
Each variant runs in its own process, the variants alternating; seconds an epoch after a
first that compiles, the CPU seconds the process used in it, and the context switches a
rank-step of the threads that run the ranks' steps and of the others (XLA's, autograd's,
tpunb's); medians over the epochs.
Run: python benchmarks/simulation_variants.py [--repeats N] (taskset -c 0 first: one CPU)
"""

import argparse
import copy
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from simulation import CORES, MODEL, _step, serial_epoch  # noqa: E402
from workload import BATCH, DATASET, clocks, since  # noqa: E402

BASELINES = {"serial, one device": 1, "serial, 8 devices": CORES}
VARIANTS = (
    *BASELINES,
    "as shipped",
    "one barrier",
    "no barriers",
    "one graph",
    "one Python thread",
    "a local op",
    "no collective",
    "rank threads on every CPU",
)


_RANK_THREADS = set()  # the native ids of the threads that run the ranks' steps


def _switches():
    """The context switches (voluntary or not) of this process's threads so far: [those of
    the threads that run ranks' steps, those of the others (XLA's, autograd's, tpunb's)]."""
    counts = [0, 0]
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread has ended
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines())
        kinds = ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        counts[int(task.name) not in _RANK_THREADS] += sum(int(fields[kind]) for kind in kinds)
    return counts


# Every epoch starts and ends with all ranks: without a collective, a rank's own epoch says
# nothing of the others' (rank 0 can finish its epochs while the others are still in theirs).
# At each edge, once every rank has arrived, the switches so far.
_EDGES = []
_EPOCH_EDGE = threading.Barrier(CORES, action=lambda: _EDGES.append(_switches()))


def _per_rank_step(start, end, rank_steps):
    return [(after - before) / rank_steps for before, after in zip(start, end, strict=True)]


def _epochs(rank, loader, epochs, all_reduce):
    import torch_xla
    import torch_xla.core.xla_model as xm

    import tpunb

    _RANK_THREADS.add(threading.get_native_id())
    model = copy.deepcopy(MODEL).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for epoch in range(epochs):
        xm.wait_device_ops()
        _EPOCH_EDGE.wait()
        start = clocks()
        for inputs, labels in tpunb.shard(loader):
            _step(model, optimizer, inputs, labels)
            xm.optimizer_step(optimizer) if all_reduce else optimizer.step()
        xm.wait_device_ops()
        _EPOCH_EDGE.wait()
        times.append(since(start) + _per_rank_step(*_EDGES[2 * epoch : 2 * epoch + 2], len(loader)))
    return times


def _dispatch(device):
    import torch_xla

    torch_xla._XLAC._xla_step_marker(device, [], wait=False, reset_scope=True)


def _without_second_barrier(meet):
    """The collective's graph dispatched after one meeting (``meet``), or none."""
    import torch_xla
    import torch_xla.runtime as xr

    from tpunb.simulation import calls, collectives

    def run_together(call):
        device = torch_xla._XLAC._xla_get_default_device()
        meeting, rank = collectives._round(), xr.global_ordinal()
        meeting.collectives[rank] += 1
        meeting.calls[rank] = (call, calls.Caller(sys._getframe()))
        if meet:
            collectives._wait_for_every_rank(meeting, rank)
            collectives._check_same_call(meeting)
        with collectives._dispatch_lock:
            _dispatch(device)
        torch_xla._XLAC._set_all_reduce_token(device, None)

    collectives._run_together = run_together


def _one_graph():
    import torch_xla
    import torch_xla.runtime as xr
    import torch_xla.torch_xla as torch_xla_module

    from tpunb.simulation import collectives

    pending = threading.local()
    collectives._run_pending_work = lambda: None
    collectives._run_together = lambda call: setattr(pending, "collective", True)
    sync = torch_xla.sync

    def sync_together(*args, **kwargs):
        if getattr(pending, "collective", False):
            pending.collective = False
            meeting, rank = collectives._round(), xr.global_ordinal()
            collectives._wait_for_every_rank(meeting, rank)
            with collectives._dispatch_lock:
                _dispatch(torch_xla._XLAC._xla_get_default_device())
            collectives._wait_for_every_rank(meeting, rank)
        return sync(*args, **kwargs)

    torch_xla.sync = torch_xla_module.sync = sync_together


def _one_python_thread():
    import torch_xla
    import torch_xla.torch_xla as torch_xla_module

    from tpunb.simulation import collectives

    turn, held = threading.Lock(), threading.local()

    def passing_the_turn(function):
        def call(*args, **kwargs):
            if getattr(held, "turn", False):
                held.turn = False
                turn.release()
            try:
                return function(*args, **kwargs)
            finally:  # a rank never waits long for its turn: nothing can hang on it
                held.turn = turn.acquire(timeout=0.005)

        return call

    collectives._Round.wait = passing_the_turn(collectives._Round.wait)
    torch_xla.sync = torch_xla_module.sync = passing_the_turn(torch_xla.sync)


def _local_op():
    """torch_xla's in-place all-reduce primitive (what xm.optimizer_step reaches), scaling
    each rank's own tensors instead of reducing across ranks."""
    import torch_xla

    def scale_only(reduce_type, inputs, scale, *groups_and_layout):
        for tensor in inputs:
            tensor.mul_(scale)

    torch_xla._XLAC._xla_all_reduce_inplace = scale_only


def _serial(devices, epochs):
    import torch_xla.core.xla_model as xm

    _RANK_THREADS.add(threading.get_native_id())
    epoch = serial_epoch(BATCH, devices)
    rank_steps = len(DATASET) // BATCH
    times = []
    for _ in range(epochs):
        xm.wait_device_ops()
        start, switches = clocks(), _switches()
        epoch()
        xm.wait_device_ops()
        times.append(since(start) + _per_rank_step(switches, _switches(), rank_steps))
    return times[1:]


def run_variant(variant, epochs):
    if variant in BASELINES:
        return _serial(BASELINES[variant], epochs)
    import tpunb

    if variant == "a local op":
        _local_op()  # before simulate wraps the primitives

    tpunb.simulate(cores=CORES)
    patch = {
        "one barrier": lambda: _without_second_barrier(meet=True),
        "no barriers": lambda: _without_second_barrier(meet=False),
        "one graph": _one_graph,
        "one Python thread": _one_python_thread,
    }.get(variant)
    if patch:
        patch()  # before the launch forks: the ranks' process inherits it
    if variant == "rank threads on every CPU":
        from tpunb.simulation import rank_cpu

        rank_cpu.CONFINED_ON = 0  # no process has 0 CPUs
    loader = DataLoader(DATASET, batch_size=BATCH, drop_last=True)
    all_reduce = variant != "no collective"
    return tpunb.launch(_epochs, loader, epochs, all_reduce, live=False)[0][1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant")
    parser.add_argument("--epochs", type=int, default=4, help="epochs a run (first untimed)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.variant:
        print(json.dumps(run_variant(options.variant, options.epochs)))
        return
    results = {variant: [] for variant in VARIANTS}
    for _ in range(options.repeats):
        for variant in VARIANTS:
            command = [
                sys.executable,
                __file__,
                f"--variant={variant}",
                f"--epochs={options.epochs}",
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
            results[variant] += json.loads(done.stdout.strip().splitlines()[-1])
    cpus = len(os.sched_getaffinity(0))
    print(
        f"8 simulated cores, per-core batch {BATCH}, {cpus} CPU(s); medians of "
        f"{len(results[VARIANTS[0]])} epochs"
    )
    print(
        f"{'variant':<24} {'s an epoch':>10} {'ratio':>6} {'CPU s an epoch':>15}"
        f" {'switches a rank-step: rank threads':>35} {'other threads':>14}"
    )
    base = statistics.median(epoch[0] for epoch in results["as shipped"])
    for variant, epochs in results.items():
        wall, cpu, ranks, others = (
            statistics.median(column) for column in zip(*epochs, strict=True)
        )
        print(
            f"{variant:<24} {wall:10.3f} {wall / base:6.2f} {cpu:15.2f}"
            f" {ranks:35.1f} {others:14.1f}"
        )


if __name__ == "__main__":
    main()
