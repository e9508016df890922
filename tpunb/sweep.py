"""``sweep_batch_sizes``: a few training steps per candidate per-core batch size on every
core, with the throughput each gives (and, on a TPU, the device memory it takes), up to the
first size that does not fit in a core's memory."""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from typing import TYPE_CHECKING

from tpunb import reports
from tpunb.errors import TpunbError, TpunbWarning
from tpunb.watch import device_memory

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
    # The smallest size that ran out of a core's memory, and the device's error; larger
    # sizes were not tried.
    did_not_fit: tuple[int, str] | None = None

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
        if self.did_not_fit:
            size, error = self.did_not_fit
            rows.append((f"batch {size} a core", f"does not fit in a core's memory: {error}"))
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
    each batch size's graphs.

    Args:
        model: the model to train (a copy of it for each size; it is left unchanged).
        dataset: the data, sharded over the cores.
        batch_sizes: the per-core batch sizes to time.
        loss_fn: ``loss_fn(model, batch)``, the batch's loss on the device.
        optimizer: builds the optimizer from the parameters; None: SGD.
        steps: timed steps a size and round.
        warmup: untimed steps before them.
        rounds: passes over every size.

    Returns:
        A ``Sweep``: time a step and samples/s by batch size (a table in a notebook)."""
    from tpunb import machine
    from tpunb.launcher import launch

    sizes = sorted(batch_sizes)
    with warnings.catch_warnings():
        # Each size is a new batch shape on purpose: the compile watch would warn about its
        # compilations (its other warnings, e.g. CPU fallbacks in loss_fn, still show).
        warnings.filterwarnings("ignore", r"(step \d+|epoch \d+, batch \d+) compiled", TpunbWarning)
        outcomes = launch(
            _sweep_on_every_core,
            *(model, dataset, sizes, loss_fn, optimizer, steps, warmup, rounds),
            live=False,
        )
    cores = len(outcomes)
    timings = [timings for timings, _ in outcomes]
    did_not_fit = next((fit for _, fit in outcomes if fit), None)
    if did_not_fit and did_not_fit[0] == sizes[0]:
        raise TpunbError(
            f"The smallest batch size, {sizes[0]} a core, does not fit in a core's memory: "
            f"{did_not_fit[1]}. Sweep smaller sizes, or make room: bf16 autocast, a smaller "
            "model."
        )
    rows = []
    for i, size in enumerate(sizes[: len(timings[0])]):
        # A round's step took as long as its slowest core (the all-reduce waits for it).
        per_round = tuple(max(t[i][r][0] for t in timings) for r in range(rounds))
        memory = timings[0][i][-1][1]
        rows.append(SweepRow(size, cores, statistics.median(per_round), memory, per_round))
    return Sweep(tuple(rows), machine.available().simulated, did_not_fit)


def _sweep_on_every_core(rank, model, dataset, sizes, loss_fn, optimizer, steps, warmup, rounds):
    import torch_xla

    device = torch_xla.device()
    timings = [[] for _ in sizes]
    did_not_fit = None  # (size, error): the first size out of memory; no larger one is tried
    for _ in range(rounds):
        for i, size in enumerate(sizes):
            if did_not_fit and size >= did_not_fit[0]:
                break
            try:
                timings[i].append(
                    _time_steps(model, dataset, size, loss_fn, optimizer, steps, warmup, device)
                )
            except RuntimeError as error:
                if not device_memory.is_out_of_memory(str(error)):
                    raise
                did_not_fit = (size, _first_line(error))
                del timings[i:]
                break
    return timings, did_not_fit


def _time_steps(model, dataset, size, loss_fn, optimizer, steps, warmup, device):
    """Seconds a step at per-core batch ``size``, and the device's peak memory."""
    import copy

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.utils.data import DataLoader

    from tpunb.sampling import shard

    replica = copy.deepcopy(model).to(device)
    opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=0.01)))(replica.parameters())
    batches = _forever(shard(DataLoader(dataset, batch_size=size, shuffle=True, drop_last=True)))
    loss = None
    for step in range(warmup + steps):
        if step == warmup:
            # Dispatch the pending step first: waiting on the devices while this
            # rank's all-reduce is still undispatched would wait for itself.
            torch_xla.sync()
            xm.wait_device_ops()
            if loss is not None:
                # An error the device met running the warm-up steps (RESOURCE_EXHAUSTED)
                # is raised here, by reading their last loss: at the size it belongs to.
                loss.item()
            start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(replica, next(batches))
        loss.backward()
        xm.optimizer_step(opt)
    torch_xla.sync()
    xm.wait_device_ops()
    seconds = (time.perf_counter() - start) / steps
    loss.item()  # the timed steps' own errors, likewise
    return seconds, _peak_memory(device)


def _first_line(error):
    """The device's own words ("Out of memory allocating 4398046511104 bytes."), without
    the "Bad StatusOr access: " torch_xla 2.8 puts before them."""
    return str(error).strip().splitlines()[0].removeprefix("Bad StatusOr access: ")


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
