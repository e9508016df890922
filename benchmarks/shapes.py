"""Variable-length batches on 8 simulated cores, as ratios measured in the same run:

1. Naive padding (each batch to its longest sequence) against 4 buckets: compilations
   and wall time of the whole launch.
2. The compile watch's own cost per step: the bucketed training timed inside the ranks,
   launched by tpunb.launch (watch, step records, hooks) against the same function
   launched by bare xmp.spawn (target: at most 1.02).

Runs alternate between the two sides; figures are medians over the repeats.
Run: python benchmarks/shapes.py [--repeats N]
"""

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch.utils.data import DataLoader

import tpunb

SAMPLES, BATCH, LENGTHS, WIDTH = 4096, 16, range(8, 128), 32

_generator = torch.Generator().manual_seed(0)
# Mostly short sequences and a long tail, as in text: batch maxima spread widely.
_lengths = (LENGTHS.start + torch.rand(SAMPLES, generator=_generator) ** 4 * len(LENGTHS)).long()
DATASET = [
    (torch.randn(int(n), WIDTH, generator=_generator), torch.randn((), generator=_generator))
    for n in _lengths
]
torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
NAIVE = tpunb.BucketCollate(range(1, LENGTHS.stop))  # every batch padded to its longest
BUCKETED = tpunb.BucketCollate(tpunb.choose_buckets(_lengths.tolist(), 4, batch_size=BATCH))


def train(rank, collate, timed_from=5):
    """Returns seconds per step after the first ``timed_from`` steps."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch.utils.data import DistributedSampler
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(DATASET, xr.world_size(), xr.global_ordinal(), shuffle=False)
    loader = DataLoader(DATASET, batch_size=BATCH, sampler=sampler, collate_fn=collate)
    steps, start = 0, None
    for inputs, targets, lengths in MpDeviceLoader(loader, device):
        if steps == timed_from:
            xm.wait_device_ops()
            start = time.perf_counter()
        mask = torch.arange(inputs.shape[1], device=device) < lengths[:, None]
        prediction = (model(inputs).squeeze(-1) * mask).sum(1) / lengths.clamp(min=1)
        loss = ((prediction - targets) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        xm.optimizer_step(optimizer)
        steps += 1
    torch_xla.sync()
    xm.wait_device_ops()
    return (time.perf_counter() - start) / (steps - timed_from)


def naive_against_buckets(repeats):
    runs = {"naive": [], "4 buckets": []}
    compiles = {}
    for _ in range(repeats):
        for name, collate in (("naive", NAIVE), ("4 buckets", BUCKETED)):
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tpunb.TpunbWarning)
                results = tpunb.launch(train, collate, 0)
            runs[name].append(time.perf_counter() - start)
            compiles[name] = results.compiles
    naive, bucketed = (statistics.median(runs[name]) for name in runs)
    a, b = compiles["naive"], compiles["4 buckets"]
    print(
        f"compilations      naive {a.compiles:4d} ({len(a.shapes)} shapes, "
        f"{a.compile_seconds:5.1f} s compiling)   4 buckets {b.compiles:4d} "
        f"({len(b.shapes)} shapes, {b.compile_seconds:5.1f} s)   ratio "
        f"{b.compiles / a.compiles:5.3f}"
    )
    print(
        f"launch wall time  naive {naive:6.2f} s   4 buckets {bucketed:6.2f} s   "
        f"ratio {bucketed / naive:5.3f}"
    )


# xmp.spawn returns nothing: the ranks' timings come back through shared memory.
_TIMES = torch.zeros(8).share_memory_()


def _timed(rank):
    _TIMES[rank] = train(rank, BUCKETED)


def watch_overhead(repeats):
    import torch_xla.distributed.xla_multiprocessing as xmp

    def bare():
        _TIMES.zero_()
        xmp.spawn(_timed, start_method="fork")
        return _TIMES.tolist()

    sides = {"bare xmp.spawn": bare, "tpunb.launch": lambda: tpunb.launch(train, BUCKETED)}
    for run in sides.values():  # warm-up
        run()
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            times[name].append(max(run()))
    base, ours = (statistics.median(times[name]) for name in sides)
    print(
        f"compile watch per step   bare xmp.spawn {base * 1000:6.2f} ms   tpunb.launch "
        f"{ours * 1000:6.2f} ms   ratio {ours / base:5.3f}   target <= 1.02"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    tpunb.simulate(cores=8)
    naive_against_buckets(max(1, repeats // 2))
    watch_overhead(repeats)


if __name__ == "__main__":
    main()
