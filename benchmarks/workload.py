"""The training workload the benchmarks share: data and a model built before any launch,
so the fork shares them with every core; and the clocks they read."""

import os
import time

import torch
from torch.utils.data import TensorDataset

SAMPLES, FEATURES, BATCH = 16384, 64, 32

_generator = torch.Generator().manual_seed(0)
DATASET = TensorDataset(
    torch.randn(SAMPLES, FEATURES, generator=_generator),
    torch.randint(0, 10, (SAMPLES,), generator=_generator),
)
torch.manual_seed(0)
MODEL = torch.nn.Sequential(
    torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
)


def clocks():
    """Wall seconds and this process's CPU seconds (all its threads: the ranks' and XLA's)."""
    cpu = os.times()
    return time.perf_counter(), cpu.user + cpu.system


def since(start, clock=clocks):
    """[wall seconds, CPU seconds] since ``start`` (from ``clock()``, ``clocks`` or one that
    reads more)."""
    return [now - then for now, then in zip(clock(), start, strict=True)]
