"""What shard() costs per step, on 8 simulated cores, against the loader written by hand
(DistributedSampler + set_epoch + MpDeviceLoader), as a ratio measured in the same run
(target: at most 1.02).

Each rank times its own epochs (launch overhead excluded) and returns seconds per step;
the two loaders alternate across repeats. Run: python benchmarks/data.py [--repeats N]
"""

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler
from workload import BATCH, DATASET, MODEL, SAMPLES

import tpunb

EPOCHS = 2


def by_hand(device):
    import torch_xla.runtime as xr
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    sampler = DistributedSampler(
        DATASET, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=True, seed=0
    )
    loader = MpDeviceLoader(
        DataLoader(DATASET, batch_size=BATCH, sampler=sampler, drop_last=True), device
    )

    def epochs():
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            yield loader

    return epochs()


def with_shard(device):
    loader = tpunb.shard(
        DataLoader(
            DATASET,
            batch_size=BATCH,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(0),
        )
    )
    return (loader for _ in range(EPOCHS))


def train(rank, loaders):
    import copy

    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    start = time.perf_counter()
    for loader in {"by hand": by_hand, "shard()": with_shard}[loaders](device):
        for inputs, labels in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            xm.optimizer_step(optimizer)
            steps += 1
    xm.wait_device_ops()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    tpunb.simulate(cores=8)
    sides = ("by hand", "shard()")
    for side in sides:  # warm-up
        tpunb.launch(train, side)
    times = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            times[side].append(max(tpunb.launch(train, side)))
    base, ours = (statistics.median(times[side]) for side in sides)
    best = min(times["shard()"]) / min(times["by hand"])
    steps = EPOCHS * SAMPLES // 8 // BATCH
    print(
        f"loader per step ({steps} steps a run)   by hand {base * 1000:6.2f} ms   "
        f"shard() {ours * 1000:6.2f} ms   ratio {ours / base:5.3f} (of medians; {best:5.3f} "
        f"of bests over {repeats})   target <= 1.02"
    )


if __name__ == "__main__":
    main()
