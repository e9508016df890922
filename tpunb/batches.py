"""Batch sizes across cores. In torch_xla a DataLoader's batch size is per core: the
global batch, the one the optimizer effectively sees, is that times the core count. This
module converts between the two, scales the learning rate with them, and reports what
an epoch will look like, with the warnings that cost TPU time."""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING

from tpunb import machine, reports
from tpunb.errors import TpunbError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

# TPU matrix units work on 8 x 128 tiles: a per-core batch that is a multiple of 8 fills them.
TPU_BATCH_MULTIPLE = 8

# The global batch last reported for each loader, to notice when the core count changed it.
_reported = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, repr=False)
class BatchReport(reports.Report):
    """What one epoch of a DataLoader looks like when split across ``cores`` cores."""

    samples: int
    cores: int
    per_core_batch: int
    drop_last: bool
    previous: object = None  # (cores, global batch) reported before for the same loader

    @property
    def global_batch(self) -> int:
        return self.per_core_batch * self.cores

    @property
    def samples_per_core(self) -> int:
        """Samples each core reads an epoch: DistributedSampler pads to a multiple of cores."""
        return math.ceil(self.samples / self.cores)

    @property
    def padded(self) -> int:
        """Samples the sampler repeats so that every core reads as many."""
        return self.samples_per_core * self.cores - self.samples

    @property
    def last_batch(self) -> int:
        """Size of each core's last batch of an epoch (0: it is full)."""
        return self.samples_per_core % self.per_core_batch

    @property
    def steps_per_epoch(self) -> int:
        full = self.samples_per_core // self.per_core_batch
        return full + (1 if self.last_batch and not self.drop_last else 0)

    @property
    def dropped(self) -> int:
        """Samples ``drop_last`` leaves out each epoch, all cores together."""
        return self.last_batch * self.cores if self.drop_last else 0

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(self._warnings())

    def _warnings(self):
        batch = self.per_core_batch
        if batch % TPU_BATCH_MULTIPLE:
            better = max(TPU_BATCH_MULTIPLE, round(batch / TPU_BATCH_MULTIPLE) * TPU_BATCH_MULTIPLE)
            yield (
                f"The per-core batch {batch} is not a multiple of {TPU_BATCH_MULTIPLE}: the TPU's "
                f"matrix units work on tiles of {TPU_BATCH_MULTIPLE} x 128 and the rest is "
                f"padding. Try batch_size={better}."
            )
        if self.last_batch and not self.drop_last:
            last = reports.count(self.last_batch, "sample")
            yield (
                f"The last batch of every epoch has {last}, not {batch}: a "
                "shape XLA has not seen, so it compiles another graph for it. Pass "
                f"drop_last=True to the DataLoader (leaves out {self.last_batch * self.cores} "
                "samples an epoch) or pick a batch size that divides "
                f"{self.samples_per_core}, the samples per core."
            )
        if self.previous and self.previous[0] != self.cores:
            cores, global_batch = self.previous
            before, now = reports.count(cores, "core"), reports.count(self.cores, "core")
            yield (
                f"The global batch changed from {global_batch} ({before}) to "
                f"{self.global_batch} ({now}) with the same per-core batch. Keep "
                f"the learning rate tuned for {global_batch} by scaling it: "
                f"tpunb.scale_learning_rate(lr, from_batch={global_batch}, "
                f"to_batch={self.global_batch}); or keep the global batch with "
                f"tpunb.per_core_batch_size({global_batch}, cores={self.cores})."
            )

    def _rows(self):
        cores = reports.count(self.cores, "core")
        steps = f"{self.steps_per_epoch}"
        if self.last_batch:
            steps += (
                f" (last batch dropped: {reports.count(self.last_batch, 'sample')} a core)"
                if self.drop_last
                else f" (the last one of {reports.count(self.last_batch, 'sample')})"
            )
        return [
            ("samples", str(self.samples)),
            ("cores", str(self.cores)),
            ("batch per core", str(self.per_core_batch)),
            ("global batch", f"{self.global_batch} ({self.per_core_batch} x {cores})"),
            ("samples per core", f"{self.samples_per_core} an epoch"),
            ("steps per epoch", steps),
            ("padded by the sampler", f"{reports.count(self.padded, 'sample')} repeated"),
            ("dropped by drop_last", f"{reports.count(self.dropped, 'sample')} an epoch"),
        ]

    def _content(self):
        return "tpunb batch report", self._rows(), self.warnings


def batch_report(loader: DataLoader, cores: int | None = None) -> BatchReport:
    """How ``loader`` splits across the cores: global batch, steps, padding, warnings.

    Args:
        loader: the DataLoader each core runs; its ``batch_size`` is per core.
        cores: the core count; None: this machine's TPU cores, or the simulated ones.

    Returns:
        A ``BatchReport`` (shown as a table in a notebook).
    """
    if loader.batch_size is None:
        raise TpunbError("batch_report needs a DataLoader built with batch_size=...")
    cores = machine.count(cores)
    report = BatchReport(
        samples=len(loader.dataset),
        cores=cores,
        per_core_batch=loader.batch_size,
        drop_last=loader.drop_last,
        previous=_reported.get(loader),
    )
    _reported[loader] = (cores, report.global_batch)
    return report


def global_batch_size(per_core: int | DataLoader, cores: int | None = None) -> int:
    """The batch the optimizer sees: ``per_core`` samples on each of the cores.

    Args:
        per_core: a DataLoader's batch size, or the DataLoader itself.
        cores: the core count; None: this machine's TPU cores, or the simulated ones.

    Returns:
        The global batch size.
    """
    if not isinstance(per_core, int):  # a DataLoader (torch is not imported here)
        if getattr(per_core, "batch_size", None) is None:
            raise TpunbError(
                "global_batch_size needs a DataLoader built with batch_size=... (or the "
                "batch size itself)."
            )
        per_core = per_core.batch_size
    return per_core * machine.count(cores)


def per_core_batch_size(global_batch: int, cores: int | None = None) -> int:
    """The DataLoader batch size that gives ``global_batch`` on the cores.

    Args:
        global_batch: the batch the optimizer should see, all cores together.
        cores: the core count; None: this machine's TPU cores, or the simulated ones.

    Returns:
        The per-core batch size; a ``TpunbError`` if it does not split evenly.
    """
    cores = machine.count(cores)
    if global_batch % cores:
        raise TpunbError(
            f"A global batch of {global_batch} does not split evenly over {cores} cores; "
            f"nearest that does: {max(cores, round(global_batch / cores) * cores)}."
        )
    return global_batch // cores


def scale_learning_rate(lr: float, from_batch: int, to_batch: int) -> float:
    """The linear scaling rule (Goyal et al., 2017, "Accurate, Large Minibatch SGD"): when the
    global batch grows k times, so does the learning rate. A starting point, best with a
    warm-up; adaptive optimizers (Adam) often want less than linear.

    Args:
        lr: the learning rate tuned at ``from_batch``.
        from_batch: the global batch it was tuned at.
        to_batch: the global batch to train with.

    Returns:
        ``lr * to_batch / from_batch``.
    """
    return lr * to_batch / from_batch
