"""In a rank: what each step did, recorded at every ``torch_xla.sync()`` and sent to the
notebook in batches (``messages.Steps``) before a later sync. A step's record holds the
values given to ``tpunb.log``, the shapes of the batches the loader handed out, and the
rank's process's new compilations, compile time and CPU fallback ops (torch_xla's metrics
are per process, and each rank is a process)."""

from __future__ import annotations

import threading
import time

from tpunb.errors import TpunbError
from tpunb.launcher import reads
from tpunb.launcher.channel import Steps
from tpunb.launcher.process_counters import ProcessCounters, excused_here
from tpunb.watch import device_memory
from tpunb.watch.history import Step

# At most this long (and a step) between a step and its record reaching the notebook.
FLUSH_SECONDS = 0.5
_rank = threading.local()  # in a rank's thread: its Recorder


class Recorder:
    """A rank's steps: filled in its thread, sent over the launch's channel."""

    def __init__(
        self, rank, channel, start, compiles=True, ledger=None, memory=True, split_syncs=True
    ):
        """``compiles``: whether it counts its process's compilations and fallbacks;
        ``ledger``: where the rank's collective calls go (``collective_calls.Ledger``), if it
        has peers; ``memory``: whether it reads its device's memory; ``split_syncs``: whether
        it looks for syncs that split a step (its watchers, ``watchers.py``)."""
        self.rank = rank
        self.channel = channel
        self.start = start
        self.step = 0
        self._values = {}  # name -> value logged in the current step
        self._shapes = []
        self._samples = 0
        self._loader = None  # the training loader's dataset, once seen
        self._epoch = self._epoch_batch = self._epoch_batches = None
        self._pass = None  # the device loader of the training loader's current pass
        self._unsent = []  # finished steps, device values not yet read back
        self._last_flush = time.monotonic()
        self._counters = ProcessCounters() if compiles else None
        self._in_framework = False  # a framework's own steps, outside its training loop
        self._reads = {}  # (kind, what, file, line) -> times read in the current step
        # The syncs that ran work since a loader last handed out a batch: the program's own
        # (what, file, line), or () for a loader's or a library's. None before any batch.
        self._batch_syncs = None
        self._ledger = ledger
        self._memory = device_memory.Reader() if memory else None
        self._split_syncs = split_syncs
        self._next_epochs = {}  # id(a notebook loader given to shard) -> [its next epoch]
        self._optimizer_steps = 0  # in the current step

    def next_epoch(self, loader):
        """The epoch the next pass over the notebook's ``loader`` runs, in a list that its
        sharded loader advances. The loader lives as long as the launch: its id is its own."""
        return self._next_epochs.setdefault(id(loader), [0])

    def log(self, values):
        """Records ``values`` (name -> number or one-element tensor) for the current step."""
        for name, value in values.items():
            self._values[name] = _scalar(name, value)

    def read(self, kind, what, file, line):
        """A read of a device value that cut the step or waited for the device
        (``reads.py``); not those of torch_xla's helpers that read after a sync."""
        if not excused_here():
            key = (kind, what, file, line)
            self._reads[key] = self._reads.get(key, 0) + 1

    def optimizer_stepped(self):
        """A torch.optim optimizer took a step (its global post-step hook)."""
        self._optimizer_steps += 1

    def collective(self, name, args, kwargs, frame):
        """A collective call about to run (``collective_calls.recorded``), made from ``frame``."""
        if self._ledger is not None:
            if self._epoch_batch is None:  # no training loader's batch yet: the syncs
                when = f"step {self.step + 1}"
            else:
                when = f"batch {self._epoch_batch}"
                when += f" of epoch {self._epoch + 1}" if self._epoch else ""
            self._ledger.record(self.rank, when, name, args, kwargs, frame)

    def framework_steps(self, on: bool) -> None:
        """From now on, steps are a framework's own (``on``: Lightning's setup, validation,
        epoch ends, teardown) or training steps again; the compile watch does not judge the
        framework's."""
        self._in_framework = on

    def batch(self, batch, device_loader):
        """A batch handed out by torch_xla's per-device loader ``device_loader`` (a new
        one each pass over the data). The training loader's batches are the step's: their
        shapes and samples; another loader's (evaluation) are counted in neither."""
        training = self._count_pass(device_loader)
        self._batch_syncs = [] if self._split_syncs else None
        shapes = _shapes(batch) if training else None
        if shapes:
            self._shapes.append(shapes)
            self._samples += shapes[0][0] if shapes[0] else 1

    def end_step(self):
        """Called right after this rank's ``torch_xla.sync()``: the step's device values
        are computed (not yet read back)."""
        record = Step(
            self.step,
            time.monotonic() - self.start,
            self._values,
            self._shapes,
            self._samples,
            epoch=self._epoch,
            epoch_batch=self._epoch_batch,
            epoch_batches=self._epoch_batches,
            framework=self._in_framework,
            reads=[[*key, times] for key, times in self._reads.items()],
            optimizer_steps=self._optimizer_steps,
        )
        if self._counters is not None:
            self._counters.fill(record)
        self._unsent.append(record)
        self.step += 1
        self._values, self._shapes, self._samples, self._reads = {}, [], 0, {}
        self._optimizer_steps = 0

    def before_sync(self):
        """Called right before this rank's ``torch_xla.sync()``. Once a loader has handed
        out a batch, a second sync that runs work in the batch split its step into two
        graphs: the program's own sync among the two is recorded as a ``"split"`` read
        (``reads.sync_ran_work`` tells, only then: it looks at the device's pending work).

        Then sends the finished steps once ``FLUSH_SECONDS`` have passed since the last
        send. Not right after the sync: reading a device value takes the device's lock,
        which the execution just dispatched holds until it ends (``TensorCollectionBarrier``
        in https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/xla_graph_executor.cpp),
        so the host would wait for the device instead of tracing the next step. A step's
        tracing later, that execution has usually ended."""
        ran_work = reads.sync_ran_work() if self._batch_syncs is not None else None
        if ran_work is not None:
            self._batch_syncs.append(ran_work)
            if len(self._batch_syncs) >= 2:
                site = self._batch_syncs[-2] or ran_work
                if site and not excused_here():
                    key = ("split", *site)
                    self._reads[key] = self._reads.get(key, 0) + 1
        if time.monotonic() - self._last_flush >= FLUSH_SECONDS:
            # The last step stays back: what the process counts after it, until the
            # function returns, joins that step at the end (finish).
            self.flush(keep_last=self._counters is not None)

    def training_data(self, dataset: object) -> None:
        """Names the training loader's dataset, when another loader may be read first
        (Lightning's sanity check reads the validation loader)."""
        if dataset is not self._loader:
            self._loader, self._pass = dataset, None
            self._epoch = self._epoch_batch = self._epoch_batches = None

    def _count_pass(self, device_loader):
        """Counts a batch of ``device_loader``'s; returns whether it is the training
        loader's."""
        if device_loader is self._pass:  # the training loader's pass under way
            self._epoch_batch += 1
            return True
        # Told apart by dataset: shard() builds a new DataLoader at each call, on the same
        # dataset.
        host_loader = getattr(getattr(device_loader, "_loader", None), "_cpu_loader", None)
        data = getattr(host_loader, "dataset", host_loader)
        if self._loader is None:
            self._loader = data
        if data is not self._loader:
            return False  # another loader (evaluation): not the training progress
        self._pass = device_loader
        self._epoch = 0 if self._epoch is None else self._epoch + 1
        self._epoch_batch = 1
        try:
            self._epoch_batches = len(device_loader)
        except TypeError:  # an IterableDataset without __len__
            self._epoch_batches = None
        return True

    def flush(self, keep_last=False):
        """Reads the logged device values back in one transfer and sends the steps (all
        but the last one if ``keep_last``)."""
        self._last_flush = time.monotonic()
        sending = self._unsent[:-1] if keep_last else self._unsent
        if not sending:
            return
        _read_back([record.values for record in sending])  # floats from here on
        use = self._memory.read() if self._memory is not None else None
        if use is not None:
            sending[-1].memory = tuple(use)
        self.channel.send(Steps.of(self.rank, sending), plain=True)
        self._unsent = self._unsent[len(sending) :]

    def flush_finished_steps(self):
        """After an error in the rank: sends the steps that ended with a sync (their
        values are computed), never syncing again; gives up quietly if reading fails."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - the rank's own error is the one to report
            self._unsent = []

    def finish(self):
        """At the end of the rank's function: the steps still unsent, and a last step for
        values logged after the last sync (synced here so they can be read)."""
        self._reads = {}  # reads after the last sync are of no step: none follows
        if self._values or self._shapes:
            if any(_on_device(v) for v in self._values.values()):
                import torch_xla

                torch_xla.sync()  # ends the step through the hook, which records it
            else:
                self.end_step()
        if self._counters is not None and self._unsent:
            self.flush(keep_last=True)
            # What the process compiled and ran on the CPU after the last step.
            self._counters.after_last_step(self._unsent[-1])
        self.flush()


def current() -> Recorder | None:
    """This rank thread's recorder; None outside a launch's rank."""
    return getattr(_rank, "recorder", None)


def enter(recorder: Recorder) -> None:
    _rank.recorder = recorder


def leave() -> None:
    _rank.recorder = None


def _scalar(name, value):
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        raise TpunbError(
            f"tpunb.log({name}=...) takes a number or a one-element tensor, got "
            f"{type(value).__name__} {value!r:.80}. Log each value under its own name."
        )
    numel = getattr(value, "numel", None)
    if numel is not None:
        if numel() != 1:
            raise TpunbError(
                f"tpunb.log({name}=...) got a tensor of shape {tuple(value.shape)}; it takes "
                "one number a name. Reduce it first, e.g. loss.mean() or acc.sum()."
            )
        # No new op (each releases the GIL) for a value already detached and 0-dim.
        if value.requires_grad:
            value = value.detach()
        return value if value.dim() == 0 else value.reshape(())
    return float(value)


def _on_device(value):
    device = getattr(value, "device", None)
    return device is not None and device.type == "xla"


def _read_back(values_by_step):
    """Replaces device tensors by floats, with one transfer for all of them."""
    places = [(values, name) for values in values_by_step for name in values]
    tensors = [values[name] for values, name in places if _on_device(values[name])]
    if tensors:
        import torch_xla

        host = iter(torch_xla._XLAC._xla_get_cpu_tensors(tensors))
    for values, name in places:
        value = values[name]
        if _on_device(value):
            values[name] = next(host).item()
        elif not isinstance(value, float):
            values[name] = float(value)


def _shapes(batch):
    """The shapes of the tensors in a batch (a tensor, or tuples, lists, dicts of them)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return [tuple(shape)]
    if isinstance(batch, dict):
        batch = batch.values()
    elif not isinstance(batch, (list, tuple)):
        return []
    return [s for item in batch for s in _shapes(item)]
