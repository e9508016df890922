"""The simulation's own cost, as ratios measured in the same run: an epoch of
data-parallel training on 8 simulated cores against

1. the same rank-steps run one after another on a single XLA CPU device (8 replicas of the
   model, each trained on its core's shard, no collective): what the simulation adds to
   torch_xla on the CPU (a process a core, collectives on the host).
2. plain PyTorch on the CPU, one model trained on the global batch: what simulating costs
   against training the same numbers without torch_xla.

and, for scale, one XLA CPU device trained on the global batch. The workload: 16,384
samples, an MLP 64-512-512-10, a per-core batch of 32 (global 256), the ranks reading
their shard through tpunb.shard in a tpunb.launch.

and JAX's own simulation of 8 host devices on the same workload, the speed anchor (when
jax is installed: the [kaggle] extra has it, or pip install jax). The simulated cores run
again, with JAX, pinned to one CPU (taskset -c 0), to show how the simulation uses the
CPUs it has.

Each side runs in its own Python process (each needs its own XLA runtime), one after
another, alternating; a side's first epoch compiles and is not timed. The figures are
medians over the timed epochs.
Run: python benchmarks/simulation.py [--epochs N] [--repeats N] [--batch N]
"""

import argparse
import copy
import importlib.util
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


def jax_devices(epochs, batch):
    """JAX's own simulation of 8 host devices (``--xla_force_host_platform_device_count``):
    the same model, data, shards and SGD, the gradients averaged with ``pmean`` in
    ``shard_map``, one jitted step a batch."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={CORES}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.shard_map import shard_map
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices("cpu")[:CORES]), ("core",))
    params = [
        (jnp.asarray(layer.weight.detach().numpy().T), jnp.asarray(layer.bias.detach().numpy()))
        for layer in MODEL
        if isinstance(layer, torch.nn.Linear)
    ]

    def loss(params, inputs, labels):
        for weight, bias in params[:-1]:
            inputs = jax.nn.relu(inputs @ weight + bias)
        logits = inputs @ params[-1][0] + params[-1][1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def core_step(params, inputs, labels):
        grads = jax.lax.pmean(jax.grad(loss)(params, inputs, labels), "core")
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    step = jax.jit(shard_map(core_step, mesh, in_specs=(P(), P("core"), P("core")), out_specs=P()))
    shards = NamedSharding(mesh, P("core"))
    # Each batch holds every core's next per-core batch, core by core, as the samplers give.
    loaders = [_loader(rank, batch) for rank in range(CORES)]

    def epoch():
        nonlocal params
        for batches in zip(*loaders, strict=True):
            inputs = np.concatenate([inputs.numpy() for inputs, _ in batches])
            labels = np.concatenate([labels.numpy() for _, labels in batches])
            params = step(params, jax.device_put(inputs, shards), jax.device_put(labels, shards))
        jax.block_until_ready(params)

    return _timed(epochs, epoch)


SIDES = {
    "simulated": simulated,
    "serial": serial,
    "one-device": one_device,
    "plain": plain,
    "jax": jax_devices,
}
PINNED = ("simulated", "jax")  # also run on one CPU (taskset -c 0)


def _run_side(name, epochs, batch, pinned=False):
    command = [sys.executable, __file__, "--side", name, f"--epochs={epochs}", f"--batch={batch}"]
    if pinned:
        command = ["taskset", "-c", "0", *command]
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
    has_jax = importlib.util.find_spec("jax") is not None
    sides = [name for name in SIDES if name != "jax" or has_jax]
    runs = [(name, False) for name in sides] + [(name, True) for name in PINNED if name in sides]
    times = {run: [] for run in runs}
    for _ in range(options.repeats):
        for name, pinned in runs:
            times[name, pinned] += _run_side(name, options.epochs, options.batch, pinned)
    epoch = {run: statistics.median(values) for run, values in times.items()}
    steps = len(DATASET) // (options.batch * CORES)
    print(
        f"an epoch: {steps} steps of {CORES} x {options.batch} samples; seconds, medians of "
        f"{len(times['plain', False])} epochs, on {os.cpu_count()} CPUs (one CPU: taskset -c 0)"
    )
    for name, pinned in runs:
        print(f"  {name + (' on one CPU' if pinned else ''):24} {epoch[name, pinned]:6.3f}")
    simulated = epoch["simulated", False]
    serial, plain = epoch["serial", False], epoch["plain", False]
    one_cpu = {name: epoch[name, False] / epoch[name, True] for name in PINNED if name in sides}
    print("8 simulated cores, a process a core as on a v5e-8:")
    if has_jax:
        _ratio("/ JAX's 8 host devices", simulated / epoch["jax", False], "<= 2.0")
    else:
        print("  / JAX's 8 host devices: jax is not installed (pip install jax)")
    jax_one_cpu = f"; JAX {one_cpu['jax']:.2f}" if has_jax else ""
    _ratio("/ the same on one CPU", one_cpu["simulated"], "<= 0.6" + jax_one_cpu)
    _ratio("/ serial rank-steps", simulated / serial, "<= 0.8")
    _ratio("/ plain PyTorch", simulated / plain, "")


def _ratio(what, ratio, target):
    print(f"  {what:28} {ratio:5.2f}  {'target ' + target if target else ''}")


if __name__ == "__main__":
    main()
