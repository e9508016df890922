"""Where a launch stands, for the live view's progress line: epoch, batch, the mean of each
logged value over the cores, samples/s (at the end: the run's mean), compilations and time
to the end of the epoch, from the tails of the history only (cheap however long the run)."""

import dataclasses

from tpunb.watch.history import RATE_OVER


@dataclasses.dataclass
class Snapshot:
    """Where a run stands: what every rank has done, and how fast."""

    elapsed: float
    steps: int  # steps of the slowest rank (of those heard from)
    epoch: int | None  # its epoch (0 for the first), None without a loader
    epoch_batch: int | None
    epoch_batches: int | None
    samples_per_second: float | None  # all cores, over the last seconds
    eta: float | None  # seconds to the end of the epoch at the slowest rank's pace
    compiles: int
    values: dict  # logged name -> mean over the ranks of their last value
    memory: tuple | None = None  # the fullest core's device memory (device_memory.Use)
    mean_samples_per_second: float | None = None  # all cores, over the whole run

    @classmethod
    def of(cls, history, compiles, elapsed):
        """From the tails of ``history`` only: cheap however long the run."""
        runs = [steps for steps in history.steps.values() if steps]  # ranks heard from
        slowest = min(runs, key=len, default=[])
        values = {}
        for name in history.names():
            last = [history.last_value(rank, name) for rank in history.steps]
            last = [v for v in last if v is not None]
            values[name] = sum(last) / len(last)  # a name is known once a rank logged it
        tail = slowest[-1] if slowest else None
        return cls(
            elapsed,
            len(slowest),
            getattr(tail, "epoch", None),
            getattr(tail, "epoch_batch", None),
            getattr(tail, "epoch_batches", None),
            history.current_samples_per_second(),
            _eta(slowest) if slowest else None,
            compiles,
            values,
            max(history.device_memory().values(), key=_fullness, default=None),
            history.mean_samples_per_second(),
        )

    def parts(self, final=False):
        """The line's parts, most important first."""
        parts = []
        if self.epoch is not None:
            of = f"/{self.epoch_batches}" if self.epoch_batches else ""
            parts.append(f"epoch {self.epoch + 1}, batch {self.epoch_batch}{of}")
        else:  # steps count syncs, epoch boundaries included: second best
            parts.append(f"step {self.steps}")
        parts += [f"{name} {value:.4g}" for name, value in self.values.items()]
        if final and self.mean_samples_per_second is not None:  # the run's, for comparing runs
            parts.append(f"{self.mean_samples_per_second:,.0f} samples/s over the run")
        elif self.samples_per_second is not None:
            parts.append(
                f"{self.samples_per_second:,.0f} samples/s over the last {RATE_OVER} steps"
            )
        parts.append(f"{self.compiles} compilations")
        if self.memory is not None:
            used, _, limit = self.memory
            of = f"/{limit / 2**30:.1f}" if limit else ""
            parts.append(f"device memory {used / 2**30:.1f}{of} GiB")
        if self.eta is not None and not final:
            parts.append(f"epoch ends in {_duration(self.eta)}")
        parts.append(f"{_duration(self.elapsed)} elapsed")
        return parts


def _fullness(use):
    """How full a device is, or, where it reports no limit, what it uses."""
    return (use.used / use.limit, 0) if use.limit else (0, use.used)


def _eta(steps, recent=20):
    last = steps[-1]
    if not last.epoch_batches or last.epoch_batch is None:
        return None
    earlier = steps[max(0, len(steps) - 1 - recent)]
    if earlier.epoch != last.epoch or last.time <= earlier.time:
        return None
    per_batch = (last.time - earlier.time) / (last.epoch_batch - earlier.epoch_batch or 1)
    return per_batch * (last.epoch_batches - last.epoch_batch)


def _duration(seconds):
    seconds = round(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"
