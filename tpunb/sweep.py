"""``sweep_batch_sizes``: a few training steps per candidate per-core batch size on every
core, with the throughput each gives (and, on a TPU, the device memory it takes)."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import TYPE_CHECKING

from tpunb import reports
from tpunb.errors import TpunbWarning

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from typing import Any

    import torch
    from matplotlib.figure import Figure
    from torch.utils.data import Dataset


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One candidate batch size: timed after its graphs were compiled. ``seconds_per_step``
    is the median of the rounds' (each round: the slowest core's mean over its steps)."""

    per_core_batch: int
    cores: int
    seconds_per_step: float
    peak_memory: object  # bytes on one core, or None where the device does not say (CPU)
    rounds: tuple = ()  # seconds a step in each round

    @property
    def global_batch(self) -> int:
        return self.per_core_batch * self.cores

    @property
    def samples_per_second_per_core(self) -> float:
        return self.per_core_batch / self.seconds_per_step

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.seconds_per_step


@dataclasses.dataclass(frozen=True, repr=False)
class Sweep(reports.Report):
    """The rows of a batch-size sweep, smallest batch first; a table in a notebook."""

    rows: tuple
    simulated: bool = False

    def _content(self):
        rows = [
            (
                f"batch {row.per_core_batch} a core",
                f"global {row.global_batch}: {row.seconds_per_step * 1000:.1f} ms a step, "
                f"{row.samples_per_second_per_core:,.0f} samples/s a core, "
                f"{row.samples_per_second:,.0f} in total"
                + (f", {row.peak_memory / 2**20:,.0f} MiB a core" if row.peak_memory else ""),
            )
            for row in self.rows
        ]
        rounds = len(self.rows[0].rounds)
        notes = (
            [f"Each time is the median of {rounds} rounds over every batch size."]
            if rounds > 1
            else []
        )
        if self.simulated:
            notes.append(
                "The cores are simulated on this machine's CPU: these are the CPU's speeds, "
                "not a TPU's."
            )
        if not any(row.peak_memory for row in self.rows):
            notes.append(
                "Device memory is not reported on this device (the CPU has no allocator stats)."
            )
        where = " simulated on the CPU" if self.simulated else ""
        return (
            f"tpunb batch-size sweep on {reports.count(self.rows[0].cores, 'core')}{where}",
            rows,
            notes,
        )

    def plot(self) -> Figure:
        """Samples/s of all cores together against the per-core batch."""
        from tpunb import plots

        sizes = [row.per_core_batch for row in self.rows]
        where = "simulated cores (the CPU)" if self.simulated else "cores"
        return plots.lines(
            {"all cores": [row.samples_per_second for row in self.rows]},
            "per-core batch size",
            "samples/s, all cores",
            f"Throughput on {self.rows[0].cores} {where}, "
            f"median of {len(self.rows[0].rounds)} rounds",
            x=sizes,
            log_x=True,
        )


def sweep_batch_sizes(
    model: torch.nn.Module,
    dataset: Dataset,
    batch_sizes: Iterable[int],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    optimizer: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    steps: int = 5,
    warmup: int = 2,
    rounds: int = 3,
) -> Sweep:
    """Train ``model`` on ``dataset`` for ``warmup`` + ``steps`` steps at each per-core batch
    size, on every core, and time the last ``steps``; ``rounds`` times over all the sizes,
    each size's time the median of its rounds (a round goes through every size, so a slow
    moment of the machine does not fall on one size only). ``loss_fn(model, batch)``
    returns the loss of a batch on the device; ``optimizer(params)`` builds the optimizer
    (SGD by default). Warm-up steps are not timed: the first round's include compiling
    each batch size's graphs."""
    from tpunb import cores as core_layout
    from tpunb.launcher import launch

    sizes = sorted(batch_sizes)
    with warnings.catch_warnings():
        # Each size is a new batch shape on purpose: the compile watch would warn about its
        # compilations (its other warnings, e.g. CPU fallbacks in loss_fn, still show).
        warnings.filterwarnings("ignore", r"(step \d+|epoch \d+, batch \d+) compiled", TpunbWarning)
        timings = launch(
            _sweep_on_every_core,
            *(model, dataset, sizes, loss_fn, optimizer, steps, warmup, rounds),
            live=False,
        )
    cores = len(timings)
    rows = []
    for i, size in enumerate(sizes):
        # A round's step took as long as its slowest core (the all-reduce waits for it).
        per_round = tuple(max(t[i][r][0] for t in timings) for r in range(rounds))
        memory = timings[0][i][-1][1]
        rows.append(SweepRow(size, cores, statistics.median(per_round), memory, per_round))
    return Sweep(tuple(rows), simulated=core_layout.available().simulated)


def _sweep_on_every_core(rank, model, dataset, sizes, loss_fn, optimizer, steps, warmup, rounds):
    import copy

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.utils.data import DataLoader

    from tpunb.sampling import shard

    device = torch_xla.device()
    timings = [[] for _ in sizes]
    for _ in range(rounds):
        for i, size in enumerate(sizes):
            replica = copy.deepcopy(model).to(device)
            opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)))(
                replica.parameters()
            )
            batches = _forever(
                shard(DataLoader(dataset, batch_size=size, shuffle=True, drop_last=True))
            )
            for step in range(warmup + steps):
                if step == warmup:
                    # Dispatch the pending step first: waiting on the devices while this
                    # rank's all-reduce is still undispatched would wait for itself.
                    torch_xla.sync()
                    xm.wait_device_ops()
                    start = time.perf_counter()
                opt.zero_grad()
                loss_fn(replica, next(batches)).backward()
                xm.optimizer_step(opt)
            torch_xla.sync()
            xm.wait_device_ops()
            timings[i].append(((time.perf_counter() - start) / steps, _peak_memory(device)))
    return timings


def _forever(sharded):
    while True:
        empty = True
        for batch in sharded:
            empty = False
            yield batch
        if empty:
            raise ValueError("the dataset has fewer samples than one batch on every core")


def _peak_memory(device):
    import torch_xla.core.xla_model as xm

    try:
        info = xm.get_memory_info(device)
    except RuntimeError:  # UNIMPLEMENTED on the CPU: GetAllocatorStats is not supported
        return None
    return info.get("peak_bytes_used") or info.get("bytes_used")
