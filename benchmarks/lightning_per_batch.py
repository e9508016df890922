"""What tpunb.lightning does at every batch, timed inside the ranks, as shares of the batch.

Epoch times of tpunb.lightning against plain Lightning (lightning_vs_launch.py) differ
by a few percent, and on a 2-CPU machine one run differs from the next by as much. This
times tpunb's own per-batch work where it runs: each part is wrapped with a clock of the
calling thread's CPU, in the ranks of one tpunb.lightning run (the shared workload, 8
simulated cores, 5 epochs, live="text"). Printed for the epochs after the first (which
compiles): each part's microseconds a rank-batch and its share of a rank-batch's CPU,
the baseline measured in the same run (every thread of the ranks' process, XLA's too).
Parts nest: a step's record includes the flush and the compile counts it sometimes runs.

Run: python benchmarks/lightning_per_batch.py  (and under `taskset -c 0` for one CPU)
"""

import collections
import functools
import json
import os
import pathlib
import resource
import sys
import tempfile
import time

from torch.utils.data import DataLoader

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lightning_vs_launch  # noqa: E402
from workload import BATCH, DATASET  # noqa: E402

import tpunb  # noqa: E402
import tpunb.lightning  # noqa: E402
from tpunb.launcher import channel, heartbeat, recorder  # noqa: E402

EPOCHS = lightning_vs_launch.EPOCHS
SPENT = collections.defaultdict(lambda: [0, 0.0])  # in a rank's process: part -> calls, CPU s

PARTS = {
    "a step's record (at each sync)": (recorder.Recorder, "end_step"),
    "  of it: reading values back, sending": (recorder.Recorder, "flush"),
    "    of it: reading values back": (recorder, "_read_back"),
    "    of it: sending": (channel.Channel, "send"),
    "  of it: the compile counts (one rank a process)": (recorder._CompileCounters, "fill"),
    "the heartbeat (at each sync)": (heartbeat, "tick"),
    "a batch's record (at each batch)": (recorder.Recorder, "batch"),
    "LiveCallback.on_train_batch_start": (tpunb.lightning.LiveCallback, "on_train_batch_start"),
    "LiveCallback.on_train_batch_end": (tpunb.lightning.LiveCallback, "on_train_batch_end"),
}


def _timed(part, owner, name):
    function = getattr(owner, name)

    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent = SPENT[part]
            spent[0] += 1
            spent[1] += time.thread_time() - start

    setattr(owner, name, timed)


def _process():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_nvcsw + usage.ru_nivcsw


class Classifier(lightning_vs_launch.Classifier):
    """lightning_vs_launch's model and step; rank 0 writes what its process spent in
    epochs 2 on, instead of each epoch's time."""

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            SPENT.clear()
            self.start = _process()

    def on_train_end(self):
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
        if self.global_rank == 0:
            cpu, switches = (now - then for now, then in zip(_process(), self.start, strict=True))
            figures = {"cpu": cpu, "switches": switches, "parts": dict(SPENT)}
            pathlib.Path(self.record).write_text(json.dumps(figures))

    def on_train_epoch_end(self):
        pass


def main():
    for part, (owner, name) in PARTS.items():
        _timed(part, owner, name)
    tpunb.simulate(cores=8)
    loader = DataLoader(DATASET, batch_size=BATCH)
    with tempfile.TemporaryDirectory() as root:
        module = Classifier(record=f"{root}/figures.json")
        trainer = tpunb.lightning.trainer(
            live="text",
            max_epochs=EPOCHS,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(module, loader)
        figures = json.loads(pathlib.Path(module.record).read_text())
    rank_batches = len(loader) * (EPOCHS - 1)  # 8 ranks, an eighth of the batches each
    batch_us = figures["cpu"] / rank_batches * 1e6
    print(
        f"\n8 simulated cores, {len(os.sched_getaffinity(0))} CPU(s), epochs 2-{EPOCHS}: "
        f"{rank_batches} rank-batches, {batch_us:.0f} us of CPU each (the ranks' process), "
        f"{figures['switches'] / rank_batches:.1f} context switches each"
    )
    print(f"{'part':<50} {'calls a batch':>13} {'us a batch':>10} {'share':>7}")
    for part in PARTS:
        calls, seconds = figures["parts"].get(part, (0, 0.0))
        us = seconds / rank_batches * 1e6
        print(f"{part:<50} {calls / rank_batches:13.2f} {us:10.1f} {us / batch_us:7.2%}")
    total = sum(
        figures["parts"].get(part, (0, 0.0))[1] for part in PARTS if not part.startswith(" ")
    )
    us = total / rank_batches * 1e6
    print(f"{'tpunb in all':<50} {'':>13} {us:10.1f} {us / batch_us:7.2%}")


if __name__ == "__main__":
    main()
