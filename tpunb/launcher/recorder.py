"""In a rank: what each step did, recorded at every ``torch_xla.sync()`` and sent to the
notebook in batches (``messages.Steps``) before a later sync. A step's record holds the
values given to ``tpunb.log``, the shapes of the batches the loader handed out, and, from
one rank a process, the process's new compilations, compile time and CPU fallback ops
(torch_xla's metrics are per process)."""

import collections
import functools
import os
import threading
import time

from tpunb.errors import TpunbError
from tpunb.history import Step
from tpunb.launcher.messages import Steps

# At most this long (and a step) between a step and its record reaching the notebook.
FLUSH_SECONDS = 0.5
_rank = threading.local()  # in a rank's thread: its Recorder
# What torch_xla's own helpers did in this process after a sync: CPU fallbacks that cut no
# graph (op -> times) and, under _COMPILES, their own graphs; not blamed on the steps.
_excused = collections.Counter()
_excused_lock = threading.Lock()
# The process's threads now in such a helper (their counts are not final yet), and the
# counts when the first of them entered.
_excusing = [0, {}]
_COMPILES = "UncachedCompile"


class Recorder:
    """A rank's steps: filled in its thread, sent over the launch's channel."""

    def __init__(self, rank, channel, start, heartbeat=None):
        """``heartbeat``: given to the one rank a process that reports its compilations."""
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
        self._counters = _CompileCounters(heartbeat) if heartbeat is not None else None
        self._in_framework = False  # a framework's own steps, outside its training loop

    def log(self, values):
        """Records ``values`` (name -> number or one-element tensor) for the current step."""
        for name, value in values.items():
            self._values[name] = _scalar(name, value)

    def framework_steps(self, on):
        """From now on, steps are a framework's own (``on``: Lightning's setup, validation,
        epoch ends, teardown) or training steps again; the compile watch does not judge the
        framework's."""
        self._in_framework = on

    def batch(self, batch, device_loader):
        """A batch handed out by torch_xla's per-device loader ``device_loader`` (a new
        one each pass over the data)."""
        self._count_pass(device_loader)
        shapes = _shapes(batch)
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
        )
        if self._counters is not None:
            self._counters.fill(record)
        self._unsent.append(record)
        self.step += 1
        self._values, self._shapes, self._samples = {}, [], 0

    def before_sync(self):
        """Called right before this rank's ``torch_xla.sync()``: sends the finished steps
        once ``FLUSH_SECONDS`` have passed since the last send. Not right after the sync:
        reading a device value takes the device's lock, which the execution just
        dispatched holds until it ends (``TensorCollectionBarrier`` in
        https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/xla_graph_executor.cpp),
        so the host would wait for the device instead of tracing the next step. A step's
        tracing later, that execution has usually ended."""
        if time.monotonic() - self._last_flush >= FLUSH_SECONDS:
            # The process's reporter keeps its last step back: the counts of the ranks
            # still running after it join that step at the end (finish).
            self.flush(keep_last=self._counters is not None)

    def training_data(self, dataset):
        """Names the training loader's dataset, when another loader may be read first
        (Lightning's sanity check reads the validation loader)."""
        if dataset is not self._loader:
            self._loader, self._pass = dataset, None
            self._epoch = self._epoch_batch = self._epoch_batches = None

    def _count_pass(self, device_loader):
        if device_loader is self._pass:  # the training loader's pass under way
            self._epoch_batch += 1
            return
        # Told apart by dataset: shard() builds a new DataLoader at each call, on the same
        # dataset.
        host_loader = getattr(getattr(device_loader, "_loader", None), "_cpu_loader", None)
        data = getattr(host_loader, "dataset", host_loader)
        if self._loader is None:
            self._loader = data
        if data is not self._loader:
            return  # another loader (evaluation): not the training progress
        self._pass = device_loader
        self._epoch = 0 if self._epoch is None else self._epoch + 1
        self._epoch_batch = 1
        try:
            self._epoch_batches = len(device_loader)
        except TypeError:  # an IterableDataset without __len__
            self._epoch_batches = None

    def flush(self, keep_last=False):
        """Reads the logged device values back in one transfer and sends the steps (all
        but the last one if ``keep_last``)."""
        self._last_flush = time.monotonic()
        sending = self._unsent[:-1] if keep_last else self._unsent
        if not sending:
            return
        _read_back([record.values for record in sending])  # floats from here on
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
        if self._values or self._shapes:
            if any(_on_device(v) for v in self._values.values()):
                import torch_xla

                torch_xla.sync()  # ends the step through the hook, which records it
            else:
                self.end_step()
        if self._counters is not None and self._unsent:
            # The steps before the last go now: another rank's failure may stop the process
            # while this one waits.
            self.flush(keep_last=True)
            # What the process's other ranks compiled and ran on the CPU after this rank's
            # last step (threads drift apart after their last collective).
            self._counters.after_last_step(self._unsent[-1])
        self.flush()


def current():
    return getattr(_rank, "recorder", None)


def excusing_fallbacks(function):
    """``function``, with the CPU fallbacks and compilations it makes while it runs
    excused: for code that reads device values only after a sync (a step closure, a
    rendezvous), so that a ``.item()`` there is not reported as cutting a step's graph."""

    @functools.wraps(function)
    def excused(*args, **kwargs):
        with _excused_lock:
            if not _excusing[0]:  # threads' calls overlap: count their span once
                _excusing[1] = _fallback_counts()
            _excusing[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            with _excused_lock:
                _excusing[0] -= 1
                if not _excusing[0]:
                    before = _excusing[1]
                    after = _fallback_counts()
                    _excused.update({op: n - before.get(op, 0) for op, n in after.items()})

    return excused


def _fallback_counts():
    """The process's CPU fallbacks (op -> times) and, under ``UncachedCompile``, its
    compilations: a helper's own graphs are compiled once and are not the step's."""
    import torch_xla.debug.metrics as met

    counts = {name: met.counter_value(name) for name in met.executed_fallback_ops()}
    counts[_COMPILES] = met.counter_value(_COMPILES) or 0
    return counts


def enter(recorder):
    _rank.recorder = recorder


def leave():
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


class _CompileCounters:
    """torch_xla's compile and fallback counters of this process, as differences between
    calls, and where the process's ranks were meanwhile (from the heartbeat): where ranks
    are threads without a collective between them, they drift apart, and a compilation
    counted in this rank's step may be another rank's, many steps earlier or later, or
    the work after its function (https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/
    csrc/xla_graph_executor.cpp counts UncachedCompile per process). Created in a rank:
    reading the metrics starts the runtime."""

    def __init__(self, heartbeat):
        import torch_xla.debug.metrics as met

        self._met = met
        self._heartbeat = heartbeat
        self._pid = os.getpid()
        self._last = None
        self._deferred = False  # the last read left its counts for a later one
        # CompileTime as last read: (samples, seconds, samples no UncachedCompile counted)
        self._compile_time = None
        self._last = self._read(every_time=True)
        self._last_ranks = self._ranks()
        self._steps_since = []  # where the ranks were at the reads since the last counted

    def fill(self, record):
        """Sets ``record``'s counters to what happened since the last call."""
        counts = self.since_last()
        record.compiles, record.cached, record.compile_seconds, record.fallbacks = counts[:4]
        record.helper_compiles = counts[4]
        (steps, done, closing), before = self._ranks(), self._last_ranks
        # Counts read late (while a helper ran) were made while the ranks were at any of
        # the reads since the last one that counted: the step that gets them spans those
        # steps, so a warm-up compilation counted late stays the warm-up's.
        self._steps_since += steps
        in_steps = before[0] + self._steps_since or [record.step]
        record.process_steps = (min(in_steps), max(in_steps))
        record.process_closing = closing or before[2] or done > before[1]
        if not self._deferred:
            self._last_ranks = steps, done, closing
            self._steps_since = []

    def after_last_step(self, record):
        """Adds to ``record`` (the reporter's last step) what the process did until all its
        ranks returned."""
        beat = self._heartbeat
        mine = [r for r in range(beat.ranks) if beat.pid(r) == self._pid]
        while not all(beat.returned(r) for r in mine):
            time.sleep(0.01)
        compiles, cached, seconds, fallbacks, helper = self.since_last(every_time=True)
        record.compiles += compiles
        record.helper_compiles += helper
        record.cached += cached
        record.compile_seconds += seconds
        for name, count in fallbacks.items():
            record.fallbacks[name] = record.fallbacks.get(name, 0) + count

    def _ranks(self):
        """The steps this process's running ranks are in, how many returned, and whether
        one is in its work after returning. Ranks not started yet may be this process's."""
        beat = self._heartbeat
        mine = [r for r in range(beat.ranks) if beat.pid(r) in (self._pid, None)]
        running = [beat.step(r) for r in mine if not beat.returned(r)]
        returned = [r for r in mine if beat.returned(r)]
        closing = any(not beat.finished(r) for r in returned)
        return running, len(returned), closing

    def _read(self, every_time=False):
        met = self._met
        with _excused_lock:
            self._deferred = bool(_excusing[0]) and self._last is not None
            if self._deferred:
                # A thread is in a helper whose counts are excused: they are told from the
                # others once it returns, so this step's go to a later one.
                compiles, _, _, fallbacks, helper_compiles = self._last
            else:
                compiles = met.counter_value(_COMPILES) or 0
                fallbacks = {
                    name: met.counter_value(name) - _excused[name]
                    for name in met.executed_fallback_ops()
                }
                helper_compiles = _excused[_COMPILES]
        return (
            compiles,
            met.counter_value("CachedCompile") or 0,
            self._compile_seconds(None if self._deferred else compiles, every_time),
            fallbacks,
            helper_compiles,
        )

    def _compile_seconds(self, compiles, every_time):
        """The process's compile seconds so far; ``compiles``: its UncachedCompile count
        (None: not read now). torch_xla counts a compilation at its cache miss and posts its
        CompileTime once it is done (``LookupCachedCompile``, then the client's ``Compile``,
        in https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/xla_graph_executor.cpp):
        the metric, whose list of samples makes it a step's costliest read, is read again
        only while a counted compilation has not posted its time, or ``every_time``."""
        if not every_time and compiles is not None and self._compile_time is not None:
            samples, seconds, uncounted = self._compile_time
            if compiles + uncounted <= samples:
                return seconds
        data = self._met.metric_data("CompileTime")
        samples, seconds = (data[0], data[1] / 1e9) if data else (0, 0.0)
        uncounted = self._compile_time[2] if self._compile_time is not None else 0
        if compiles is not None:  # samples beyond the count: compilations it does not count
            uncounted = max(samples - compiles, uncounted)
        self._compile_time = samples, seconds, uncounted
        return seconds

    def since_last(self, every_time=False):
        """The counts since the last call (``every_time``: CompileTime read whatever the
        count says, for the last step)."""
        now = self._read(every_time)
        (compiles, cached, seconds, fallbacks, helper), before = now, self._last
        self._last = now
        new_fallbacks = {
            name: count - before[3].get(name, 0)
            for name, count in fallbacks.items()
            if count != before[3].get(name, 0)
        }
        since = compiles - before[0], cached - before[1], seconds - before[2]
        return (*since, new_fallbacks, helper - before[4])
