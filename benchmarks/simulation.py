"""The simulation's own cost, as ratios measured in the same run: an epoch of
data-parallel training on 8 simulated cores against

1. the same rank-steps run one after another on a single XLA CPU device (8 replicas of the
   model, each trained on its core's shard, no collective): what the simulation adds to
   torch_xla on the CPU (threads, collectives, barriers).
2. plain PyTorch on the CPU, one model trained on the global batch: what simulating costs
   against training the same numbers without torch_xla.

and, for scale, one XLA CPU device trained on the global batch. The workload: 16,384
samples, an MLP 64-512-512-10, a per-core batch of 32 (global 256), the ranks reading
their shard through tpunb.shard in a tpunb.launch.

The figures in brackets were measured on this workload before each collective became a
graph of its own (2.37 s an epoch; docs/simulation.md, "What it costs").

Each side runs in its own Python process (each needs its own XLA runtime), one after
another, alternating; a side's first epoch compiles and is not timed. The figures are
medians over the timed epochs.
Run: python benchmarks/simulation.py [--epochs N] [--repeats N] [--batch N]
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import BATCH, DATASET, FEATURES  # noqa: E402

CORES = 8
torch.manual_seed(0)
# Wider than the other benchmarks' model: the workload the simulation's figures are given for.
MODEL = torch.nn.Sequential(
    torch.nn.Linear(FEATURES, 512),
    torch.nn.ReLU(),
    torch.nn.Linear(512, 512),
    torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
)


def _loader(rank, batch):
    sampler = DistributedSampler(DATASET, CORES, rank, shuffle=False)
    return DataLoader(DATASET, batch_size=batch, sampler=sampler, drop_last=True)


def _step(model, optimizer, inputs, labels):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()


def _timed(epochs, run_epoch, wait=lambda: None):
    """Seconds each of ``epochs`` runs of ``run_epoch`` took, ``wait`` done before the clock
    starts and before it stops (the device's queued work)."""
    times = []
    for _ in range(epochs):
        wait()
        start = time.perf_counter()
        run_epoch()
        wait()
        times.append(time.perf_counter() - start)
    return times


def _simulated_epochs(rank, epochs, loader):
    import torch_xla
    import torch_xla.core.xla_model as xm

    import tpunb

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = tpunb.shard(loader)  # this core's shard, on the core (MpDeviceLoader syncs)

    def epoch():
        for inputs, labels in batches:
            _step(model, optimizer, inputs, labels)
            xm.optimizer_step(optimizer)  # all-reduces the gradients

    return _timed(epochs, epoch, xm.wait_device_ops)


def simulated(epochs, batch):
    import tpunb

    tpunb.simulate(cores=CORES)
    loader = DataLoader(DATASET, batch_size=batch, drop_last=True)
    per_rank = tpunb.launch(_simulated_epochs, epochs, loader, live=False)
    # An epoch ends with its slowest core.
    return [max(epoch) for epoch in zip(*per_rank, strict=True)]


def _xla_cpu_devices(count):
    from tpunb.simulation import set_compile_level

    os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(count))
    set_compile_level(os.environ)  # compiled as the simulated cores' graphs are
    import torch_xla

    return [torch_xla.device(index) for index in range(count)]


def serial_epoch(batch, devices=1):
    """An epoch of the serial rank-steps (one model a rank, each trained on its shard, one
    after another, from one Python thread), as a function to call. The XLA runtime has
    ``devices`` CPU devices and rank r's model is on device r % ``devices``: with 1, they
    share one device; with 8, each has its own, as on simulated cores."""
    import torch_xla

    places = _xla_cpu_devices(devices)
    places = [places[rank % devices] for rank in range(CORES)]
    models = [copy.deepcopy(MODEL).to(place) for place in places]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    ranks = list(zip(places, models, optimizers, strict=True))

    def epoch():
        for batches in zip(*(_loader(rank, batch) for rank in range(CORES)), strict=True):
            for (place, model, optimizer), (inputs, labels) in zip(ranks, batches, strict=True):
                torch_xla._XLAC._xla_set_default_device(str(place))  # what sync() runs
                _step(model, optimizer, inputs.to(place), labels.to(place))
                optimizer.step()
                torch_xla.sync()

    return epoch


def serial(epochs, batch):
    import torch_xla.core.xla_model as xm

    epoch = serial_epoch(batch)
    return _timed(epochs, epoch, xm.wait_device_ops)


def _global_batch_epoch(batch, device, sync=lambda: None):
    """An epoch of one model trained on the global batch, on ``device``."""
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(DATASET, batch_size=batch * CORES, shuffle=False, drop_last=True)

    def epoch():
        for inputs, labels in loader:
            _step(model, optimizer, inputs.to(device), labels.to(device))
            optimizer.step()
            sync()

    return epoch


def one_device(epochs, batch):
    import torch_xla
    import torch_xla.core.xla_model as xm

    epoch = _global_batch_epoch(batch, _xla_cpu_devices(1)[0], torch_xla.sync)
    return _timed(epochs, epoch, xm.wait_device_ops)


def plain(epochs, batch):
    return _timed(epochs, _global_batch_epoch(batch, "cpu"))


SIDES = {"simulated": simulated, "serial": serial, "one-device": one_device, "plain": plain}


def _run_side(name, epochs, batch):
    command = [sys.executable, __file__, "--side", name, f"--epochs={epochs}", f"--batch={batch}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])[1:]  # the first compiles


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs a run (first untimed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side")
    parser.add_argument("--batch", type=int, default=BATCH, help="per-core batch size")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.side:
        print(json.dumps(SIDES[options.side](options.epochs, options.batch)))
        return
    times = {name: [] for name in SIDES}
    for _ in range(options.repeats):
        for name in SIDES:
            times[name] += _run_side(name, options.epochs, options.batch)
    epoch = {name: statistics.median(values) for name, values in times.items()}
    steps = len(DATASET) // (options.batch * CORES)
    print(
        f"an epoch: {steps} steps of {CORES} x {options.batch} samples; seconds, medians of "
        f"{len(times['plain'])} epochs"
    )
    print(
        f"plain PyTorch, global batch {epoch['plain']:6.3f}   one XLA CPU device, global batch "
        f"{epoch['one-device']:6.3f}   serial rank-steps {epoch['serial']:6.3f}   "
        f"8 simulated cores {epoch['simulated']:6.3f}"
    )
    print(
        f"8 simulated cores / serial rank-steps {epoch['simulated'] / epoch['serial']:5.2f} "
        f"(before: 1.04)   / plain PyTorch "
        f"{epoch['simulated'] / epoch['plain']:5.2f} (before: 6.3)"
    )


if __name__ == "__main__":
    main()
