"""What tpunb.launch costs, on 8 simulated cores, as ratios measured in the same run.

1. Launch overhead: tpunb.launch of a trivial function against a bare
   xmp.spawn(..., start_method="fork") of the same function (target: at most 1.10).
2. A full data-parallel epoch through tpunb.launch against the same loop launched by
   hand with xmp.spawn (target: at most 1.05).

Runs alternate between the two sides so drift on the machine hits both alike; each
figure is the median of the repeats. Run: python benchmarks/launch.py [--repeats N]
"""

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tpunb

SAMPLES, FEATURES, BATCH = 16384, 64, 32

# Built once before any launch: the fork shares them with every core.
generator = torch.Generator().manual_seed(0)
DATASET = TensorDataset(
    torch.randn(SAMPLES, FEATURES, generator=generator), torch.randint(0, 10, (SAMPLES,), generator=generator)
)
torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


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
    loader = MpDeviceLoader(DataLoader(DATASET, batch_size=BATCH, sampler=sampler, drop_last=True), device)
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


def compare(name, fn, repeats, target):
    import torch_xla.distributed.xla_multiprocessing as xmp

    sides = {
        "xmp.spawn": lambda: xmp.spawn(fn, start_method="fork"),
        "tpunb.launch": lambda: tpunb.launch(fn),
    }
    for call in sides.values():  # warm-up: imports and first compilations
        call()
    times = {side: [] for side in sides}
    for _ in range(repeats):
        for side, call in sides.items():
            times[side].append(seconds(call))
    base, ours = (statistics.median(times[s]) for s in sides)
    print(
        f"{name:<28} xmp.spawn {base:7.3f} s   tpunb.launch {ours:7.3f} s   "
        f"ratio {ours / base:5.3f}   (target <= {target:.2f}, median of {repeats})"
    )
    return ours / base


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    tpunb.simulate(cores=8)
    compare("launch of a trivial function", trivial, repeats, 1.10)
    steps = SAMPLES // 8 // BATCH
    compare(f"data-parallel epoch ({steps} steps)", epoch, repeats, 1.05)


if __name__ == "__main__":
    main()
