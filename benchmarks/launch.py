"""What tpunb.launch costs, on 8 simulated cores, as ratios measured in the same run.

1. Launch overhead: tpunb.launch of a trivial function against a bare
   xmp.spawn(..., start_method="fork") of the same function (target: at most 1.10).
2. A full data-parallel epoch through tpunb.launch against the same loop launched by
   hand with xmp.spawn (target: at most 1.05).
3. The hang watchdog's cost: the same epoch with the watchdog on (the default) against
   hang_timeout=None (target: nothing measurable, i.e. within noise of 1.00).
4. Each watcher (tpunb/launcher/watchers.py: compiles, reads, collectives, memory): the
   same epoch against the same launch with that watcher left out (target: at most 1.02
   each), and what one call recorded in the ledger of collective calls costs
   (xm.optimizer_step's all-reduce of the model's gradients).

Runs alternate between the two sides so drift on the machine hits both alike; each
figure is the median of the repeats, and the ratio of the best runs is printed too (on
a busy 2-core machine the best run is the one least disturbed).

Run: python benchmarks/launch.py [--repeats N]
"""

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler
from workload import BATCH, DATASET, MODEL, SAMPLES

import tpunb


def trivial(rank):
    return None


def epoch(rank):
    """One data-parallel epoch, written the way torch_xla's examples do it."""
    import copy

    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    sampler = DistributedSampler(DATASET, num_replicas=xr.world_size(), rank=xr.global_ordinal())
    loader = MpDeviceLoader(
        DataLoader(DATASET, batch_size=BATCH, sampler=sampler, drop_last=True), device
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, labels in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        xm.optimizer_step(optimizer)
    return None


def seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def compare(name, sides, repeats, target):
    """Median seconds of each side's call, alternating sides; prints second / first."""
    for call in sides.values():  # warm-up: imports and first compilations
        call()
    times = {side: [] for side in sides}
    for _ in range(repeats):
        for side, call in sides.items():
            times[side].append(seconds(call))
    (base_name, base), (our_name, ours) = ((s, statistics.median(times[s])) for s in sides)
    best = min(times[our_name]) / min(times[base_name])
    print(
        f"{name:<32} {base_name} {base:6.3f} s   {our_name} {ours:6.3f} s   "
        f"ratio {ours / base:5.3f} (of medians; {best:5.3f} of bests over {repeats})   "
        f"target <= {target:.2f}"
    )


def against_xmp_spawn(fn):
    import torch_xla.distributed.xla_multiprocessing as xmp

    return {
        "xmp.spawn": lambda: xmp.spawn(fn, start_method="fork"),
        "tpunb.launch": lambda: tpunb.launch(fn),
    }


def launched_without(fn, name):
    """tpunb.launch(fn) with the watcher ``name`` left out (as tpunb.launch, but for the
    plan's ``unwatched``)."""
    import dataclasses

    from tpunb.launcher import preflight, supervise
    from tpunb.launcher.launchers import XmpSpawn

    plan = preflight.checked(hang_timeout=600, view="auto", fn=fn)
    plan = dataclasses.replace(plan, unwatched=frozenset({name}))
    return supervise(plan, XmpSpawn(plan.cores), fn)


def one_recorded_call(calls=2000):
    """Seconds a call of the ledger's, for the all-reduce of the model's gradients."""
    import sys

    from tpunb.watch import collective_calls

    book = collective_calls.Ledger(1)
    gradients = [p.detach() for p in MODEL.parameters()]
    frame = sys._getframe()
    start = time.perf_counter()
    for _ in range(calls):
        book.record(0, "step 1", "all_reduce", ("sum", gradients), {"scale": 0.125}, frame)
    elapsed = (time.perf_counter() - start) / calls
    book.close()
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    tpunb.simulate(cores=8)
    steps = SAMPLES // 8 // BATCH
    compare("launch of a trivial function", against_xmp_spawn(trivial), repeats, 1.10)
    compare(f"data-parallel epoch ({steps} steps)", against_xmp_spawn(epoch), repeats, 1.05)
    watchdog = {
        "watchdog off": lambda: tpunb.launch(epoch, hang_timeout=None),
        "watchdog on": lambda: tpunb.launch(epoch),
    }
    compare("the same epoch, hang watchdog", watchdog, repeats, 1.00)
    from tpunb.launcher import watchers

    for name in watchers.NAMES:
        sides = {
            f"{name} off": lambda name=name: launched_without(epoch, name),
            f"{name} on": lambda: tpunb.launch(epoch),
        }
        compare(f"the same epoch, {name} watcher", sides, repeats, 1.02)
    print(f"one recorded collective call: {one_recorded_call() * 1e6:.1f} us (a call a step)")


if __name__ == "__main__":
    main()
