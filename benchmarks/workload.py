"""The training workload the benchmarks share: data and a model built before any launch,
so the fork shares them with every core; the clocks they read; and running one side of a
comparison in a new Python process."""

import json
import os
import statistics
import subprocess
import sys
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


RESULT = "RESULT "  # a run in a new process prints its figures as JSON on a line after this


def run_in_new_process(script, *arguments):
    """The figures ``script`` (run with ``arguments`` in a new Python process, so that no
    earlier run's leftovers reach it) printed after ``RESULT``."""
    done = subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{script} {' '.join(arguments)} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def interval(ratios):
    """The mean of ``ratios`` and its 95% interval (two standard errors)."""
    mean = statistics.mean(ratios)
    if len(ratios) < 2:
        return f"mean {mean:.3f}"
    half = 2 * statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"mean {mean:.3f}, 95% interval {mean - half:.3f}-{mean + half:.3f}"
