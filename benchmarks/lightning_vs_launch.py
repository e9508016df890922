"""PyTorch Lightning against tpunb.launch, on 8 simulated cores, in the same run.

The same training (the shared workload, SGD, the same per-core batch, 5 epochs) three ways:

- launch: tpunb.launch with tpunb.shard (the baseline);
- lightning: a plain lightning.Trainer(accelerator="tpu", devices=8), no progress bar, the
  loss never read;
- tpunb.lightning: tpunb.lightning.trainer(...) (Lightning watched by tpunb, live="text":
  every step's loss read back for the history and the view);
- lightning, bar: the plain trainer showing the loss the way Lightning does, the module
  logging it with self.log("loss", loss, prog_bar=True) and the progress bar on (what
  tpunb.lightning's view stands in for).

Printed as ratios to the baseline: seconds an epoch after the first (timed in rank 0,
compilation done), the CPU seconds the ranks' process used in it (every rank's thread and
XLA's: what a side adds, with less of the machine's noise than wall time), the context
switches of that process's threads in it (a count: what a side makes threads wait and
wake for), and the whole call (fork, setup, teardown included). Sides alternate so drift
on the machine hits all alike; figures are medians over the repeats, and
"tpunb.lightning / lightning" (the target: at most 1.02) is the median of each repeat's
own ratio (the runs of a repeat ran one after the other), with its mean and the 95%
interval of that mean, and so is "tpunb.lightning / lightning, bar": on a 2-CPU machine
one pair's ratio spreads by about 0.07, so telling 1.02 from 1.04 takes 20 pairs or more.
With --fresh each run is a new Python process (nothing of one run is left in the next's
parent, at about 5 s of start-up a run).
Run: python benchmarks/lightning_vs_launch.py [--repeats N] [--fresh]
"""

import argparse
import contextlib
import copy
import json
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

import lightning
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
import tpunb.lightning  # noqa: E402

EPOCHS = 5  # 4 timed a run: pairs of runs differ by up to 10% on a 2-CPU machine


def _clocks():
    """``clocks()``, then the context switches of this process's threads so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (*clocks(), usage.ru_nvcsw + usage.ru_nivcsw)


def _train(rank, loader):
    import torch_xla
    import torch_xla.core.xla_model as xm

    model = copy.deepcopy(MODEL).to(torch_xla.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sharded = tpunb.shard(loader)
    epochs = []
    for _ in range(EPOCHS):
        start = _clocks()
        for x, y in sharded:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            xm.optimizer_step(optimizer)
        xm.wait_device_ops()
        epochs.append(since(start, _clocks))
    return epochs


def run_launch(loader):
    return tpunb.launch(_train, loader, live=False)[0]


class Classifier(lightning.LightningModule):
    """The same model and step; records rank 0's epoch times (Lightning pickles the module
    into the ranks, so it lives at module level)."""

    def __init__(self, record, show_loss=False):
        super().__init__()
        self.model = copy.deepcopy(MODEL)
        self.record = record
        self.show_loss = show_loss  # in Lightning's progress bar
        self.epochs, self.start = [], None

    def training_step(self, batch, batch_index):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        if self.show_loss:
            self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_epoch_start(self):
        self.start = _clocks()

    def on_train_epoch_end(self):
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        self.epochs.append(since(self.start, _clocks))
        if self.global_rank == 0:
            pathlib.Path(self.record).write_text(json.dumps(self.epochs))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run_lightning(loader, watched, bar=False):
    with tempfile.TemporaryDirectory() as root:
        module = Classifier(record=f"{root}/epochs.txt", show_loss=bar)
        arguments = dict(
            max_epochs=EPOCHS,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=bar,
            default_root_dir=root,
        )
        if watched:
            trainer = tpunb.lightning.trainer(live="text", **arguments)
        else:
            trainer = lightning.Trainer(accelerator="tpu", devices=8, **arguments)
        with contextlib.ExitStack() as quiet:
            if bar:  # drawn in the ranks' process, forked with these streams: not printed
                nowhere = quiet.enter_context(open(os.devnull, "w"))
                quiet.enter_context(contextlib.redirect_stdout(nowhere))
                quiet.enter_context(contextlib.redirect_stderr(nowhere))
            trainer.fit(module, loader)
        return json.loads(pathlib.Path(module.record).read_text())


SIDES = ("launch", "lightning", "tpunb.lightning", "lightning, bar")


def run_side(name):
    """One run of side ``name`` in this process (simulated cores already set up): its
    epochs after the first (which compiles) and the whole call's seconds."""
    loader = DataLoader(DATASET, batch_size=BATCH)
    start = time.perf_counter()
    if name == "launch":
        epochs = run_launch(loader)
    else:
        epochs = run_lightning(
            loader, watched=name == "tpunb.lightning", bar=name == "lightning, bar"
        )
    return epochs[1:], time.perf_counter() - start


def run_side_in_new_process(name):
    """``run_side`` in a new Python process: no run's leftovers (the parent's memory, its
    threads) reach the next one."""
    return run_in_new_process(__file__, "--one", name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--fresh", action="store_true", help="each run in a new Python process (slower to start)"
    )
    parser.add_argument("--one", choices=SIDES, help=argparse.SUPPRESS)  # a --fresh run
    arguments = parser.parse_args()
    if arguments.one:
        tpunb.simulate(cores=8)
        print(RESULT + json.dumps(run_side(arguments.one)), flush=True)
        return
    if arguments.fresh:
        run = run_side_in_new_process
    else:
        tpunb.simulate(cores=8)
        run = run_side
    repeats = arguments.repeats
    epoch, cpu, switches, total = ({name: [] for name in SIDES} for _ in range(4))
    for _ in range(repeats):
        for name in SIDES:
            epochs, call_seconds = run(name)
            total[name].append(call_seconds)
            epoch[name].append(statistics.median(wall for wall, _, _ in epochs))
            cpu[name].append(statistics.median(seconds for _, seconds, _ in epochs))
            switches[name].append(statistics.median(count for _, _, count in epochs))
    base = {
        figure: statistics.median(values["launch"])
        for figure, values in (
            ("epoch", epoch),
            ("cpu", cpu),
            ("switches", switches),
            ("total", total),
        )
    }
    where = "each run in a new process" if arguments.fresh else "one process"
    print(
        f"\n8 simulated cores, {len(DATASET)} samples, per-core batch {BATCH}, {EPOCHS} epochs, "
        f"{len(os.sched_getaffinity(0))} CPU(s), {repeats} repeats, {where}"
    )
    print(
        f"{'side':<16} {'s/epoch':>8} {'ratio':>6} {'CPU s/epoch':>12} {'ratio':>6} "
        f"{'switches/epoch':>15} {'ratio':>6} {'whole call s':>13} {'ratio':>6}"
    )
    for name in SIDES:
        e, c, s, t = (statistics.median(values[name]) for values in (epoch, cpu, switches, total))
        print(
            f"{name:<16} {e:8.3f} {e / base['epoch']:6.2f} {c:12.2f} {c / base['cpu']:6.2f} "
            f"{s:15.0f} {s / base['switches']:6.2f} {t:13.2f} {t / base['total']:6.2f}"
        )
    for against in ("lightning", "lightning, bar"):
        for figure, values in (
            ("s/epoch", epoch),
            ("CPU s/epoch", cpu),
            ("switches/epoch", switches),
        ):
            ratios = [
                w / p for w, p in zip(values["tpunb.lightning"], values[against], strict=True)
            ]
            print(
                f"tpunb.lightning / {against}, {figure}: median {statistics.median(ratios):.3f}, "
                f"{interval(ratios)} (each repeat: {', '.join(f'{r:.3f}' for r in ratios)})"
            )


if __name__ == "__main__":
    main()
