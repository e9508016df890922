"""What a value logged at every step costs on simulated cores, as ratios of one run.

The same training on 8 simulated cores (tpunb.launch with tpunb.shard on the shared
workload, SGD, 5 epochs, live=False) with, at every step:

- nothing: no value logged (the baseline);
- a number: tpunb.log(step=...) of a Python int (tpunb's records of a value);
- the loss: tpunb.log(loss=loss), the device tensor (as tpunb takes it: held on the device
  until the flush, every 0.5 s, then read back in one transfer);
- the loss, not read: the same, with the flush replacing the values by NaN instead of
  reading them (what holding them costs);
- the loss a step later: the loop reads its previous step's loss with .item() before this
  step's sync, and logs the number (one value held, a transfer a step);
- the loss at once: tpunb.log(loss=loss.item()) right after backward (the step's graph
  runs there and the host waits for it; the optimizer's runs at the next sync).

Printed: seconds an epoch after the first (timed in rank 0) and the CPU seconds of the
ranks' process in it, as medians, and each variant's ratio to "nothing" in the same round
(each run in a new Python process, the variants in turn), with the 95% interval of its
mean.

Then the same two ways, nothing and the loss, on a step the device takes longer for than
the host, as on a TPU (one simulated core: the host's own work of a step 50 ms, a sleep
standing for preparing its batch; the device's about 80 ms of matrix products): the host
overlaps its work with the device's while the values are read back, or not (seconds a step).
Run: python benchmarks/logged_values.py [--rounds N]
"""

import argparse
import copy
import json
import math
import pathlib
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from workload import (  # noqa: E402
    BATCH,
    DATASET,
    MODEL,
    RESULT,
    clocks,
    interval,
    run_in_new_process,
    since,
)

import tpunb  # noqa: E402

EPOCHS = 5
VARIANTS = (
    "nothing",
    "a number",
    "the loss",
    "the loss, not read",
    "the loss a step later",
    "the loss at once",
)
DEVICE_BOUND = ("device-bound, nothing", "device-bound, the loss")
HOST_SECONDS, DEVICE_BOUND_STEPS, WARM_UP = 0.05, 40, 10


def _train(rank, loader, variant):
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = copy.deepcopy(MODEL).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sharded = tpunb.shard(loader)
    epochs, steps, previous = [], 0, None
    for _ in range(EPOCHS):
        start = clocks()
        for x, y in sharded:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if variant == "a number":
                tpunb.log(step=steps)
            elif variant in ("the loss", "the loss, not read"):
                tpunb.log(loss=loss)
            elif variant == "the loss a step later":
                if previous is not None:
                    tpunb.log(loss=previous.item())
                previous = loss.detach()
            elif variant == "the loss at once":
                tpunb.log(loss=loss.item())
            xm.optimizer_step(optimizer)
            steps += 1
        xm.wait_device_ops()
        epochs.append(since(start))
    return epochs[1:]


def _device_bound(rank, log):
    """Seconds a step (after the warm-up) of a step whose device work outlasts the host's."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    weights = torch.randn(1024, 1024, device=device) / 32
    x = torch.randn(1024, 1024, device=device)
    for step in range(DEVICE_BOUND_STEPS):
        if step == WARM_UP:
            xm.wait_device_ops()
            start = time.perf_counter()
        time.sleep(HOST_SECONDS)  # the host's own work, e.g. preparing the batch
        for _ in range(12):
            x = torch.tanh(x @ weights)
        if log:
            tpunb.log(loss=x[0, 0])
        torch_xla.sync()
    xm.wait_device_ops()
    return (time.perf_counter() - start) / (DEVICE_BOUND_STEPS - WARM_UP)


def _not_read(values_by_step):
    """The flush's read-back replaced: each device value becomes NaN, unread."""
    for values in values_by_step:
        for name in values:
            values[name] = math.nan


def run_variant(variant):
    """[seconds an epoch, CPU seconds an epoch] of one run, in this process (for a
    device-bound variant, [seconds a step])."""
    if variant in DEVICE_BOUND:
        tpunb.simulate(cores=1)
        return tpunb.launch(_device_bound, variant == DEVICE_BOUND[1], live=False)
    tpunb.simulate(cores=8)
    if variant == "the loss, not read":
        from tpunb.launcher import recorder

        recorder._read_back = _not_read
    loader = DataLoader(DATASET, batch_size=BATCH)
    epochs = tpunb.launch(_train, loader, variant, live=False)[0]
    return [statistics.median(wall for wall, _ in epochs), statistics.median(c for _, c in epochs)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--one", choices=VARIANTS + DEVICE_BOUND, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        print(RESULT + json.dumps(run_variant(arguments.one)), flush=True)
        return
    runs = {variant: [] for variant in VARIANTS + DEVICE_BOUND}
    for _ in range(arguments.rounds):
        for variant in VARIANTS + DEVICE_BOUND:
            runs[variant].append(run_in_new_process(__file__, "--one", variant))
    print(
        f"\n8 simulated cores, {len(DATASET)} samples, per-core batch {BATCH}, {EPOCHS} epochs "
        f"(the first not counted), {arguments.rounds} rounds, each run in a new process"
    )
    for figure, index in (("s/epoch", 0), ("CPU s/epoch", 1)):
        print(f"{figure}:")
        for variant in VARIANTS:
            ratios = [
                run[index] / base[index]
                for run, base in zip(runs[variant], runs["nothing"], strict=True)
            ]
            median = statistics.median(run[index] for run in runs[variant])
            against = "" if variant == "nothing" else f"  / nothing: {interval(ratios)}"
            print(f"  {variant:<22} {median:6.3f}{against}")
    nothing, logged = DEVICE_BOUND
    seconds = {variant: [run[0] for run in runs[variant]] for variant in DEVICE_BOUND}
    print(
        f"one core, a step of {HOST_SECONDS * 1000:.0f} ms on the host and more on the device, "
        f"s/step: nothing {statistics.median(seconds[nothing]):.3f}, the loss "
        f"{statistics.median(seconds[logged]):.3f}  / nothing: "
        f"{interval([a / b for a, b in zip(seconds[logged], seconds[nothing], strict=True)])}"
    )


if __name__ == "__main__":
    main()
