"""torch_xla's compile and CPU fallback counters of a rank's process (a process a rank, as
on a v5e-8: torch_xla counts per process), read as differences between the rank's steps,
and what torch_xla's own helpers that read values after a sync (step closures, rendezvous)
add to them: excused, not the steps' doing."""

import collections
import dataclasses
import functools
import threading

_thread = threading.local()  # ``excused``: depth of excused helpers running in this thread


@dataclasses.dataclass
class _Excused:
    """What torch_xla's own helpers did in this process after a sync (``counts``: CPU
    fallbacks that cut no graph, op -> times, and under _COMPILES their own graphs; not
    blamed on the steps); the process's threads now in such a helper (their counts are not
    final yet: a helper may run inside another, or in a thread of the program's), and the
    counts when the first of them entered. The process's: torch_xla counts per process."""

    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    threads: int = 0
    counts_before: dict = dataclasses.field(default_factory=dict)


_excused = _Excused()  # this process's, a rank's on a v5e-8 as here
_COMPILES = "UncachedCompile"

# The process's counts at a read, or their differences since the last: compilations
# (UncachedCompile), cache hits, compile seconds, CPU fallbacks (op -> times, the
# excused left out) and the excused helpers' own compilations.
_Counts = collections.namedtuple("_Counts", "compiles cached seconds fallbacks helper")


def excusing(function):
    """``function``, with the CPU fallbacks and compilations it makes while it runs
    excused: for code that reads device values only after a sync (a step closure, a
    rendezvous), so that a ``.item()`` there is not reported as cutting a step's graph."""

    @functools.wraps(function)
    def excused(*args, **kwargs):
        __tracebackhide__ = True  # a rank's traceback shows the program's call, not this
        _thread.excused = getattr(_thread, "excused", 0) + 1
        with _excused.lock:
            if not _excused.threads:  # threads' calls overlap: count their span once
                _excused.counts_before = _fallback_counts()
            _excused.threads += 1
        try:
            return function(*args, **kwargs)
        finally:
            _thread.excused -= 1
            with _excused.lock:
                _excused.threads -= 1
                if not _excused.threads:
                    before = _excused.counts_before
                    after = _fallback_counts()
                    _excused.counts.update({op: n - before.get(op, 0) for op, n in after.items()})

    return excused


def _fallback_counts():
    """The process's CPU fallbacks (op -> times) and, under ``UncachedCompile``, its
    compilations: a helper's own graphs are compiled once and are not the step's."""
    import torch_xla.debug.metrics as met

    counts = {name: met.counter_value(name) for name in met.executed_fallback_ops()}
    counts[_COMPILES] = met.counter_value(_COMPILES) or 0
    return counts


class ProcessCounters:
    """torch_xla's compile and fallback counters of this rank's process, as differences
    between calls (https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/
    xla_graph_executor.cpp counts UncachedCompile per process). Created in a rank: reading
    the metrics starts the runtime."""

    def __init__(self):
        import torch_xla.debug.metrics as met

        self._met = met
        self._last = None
        self._deferred = False  # the last read left its counts for a later one
        # CompileTime as last read: (samples, seconds, samples no UncachedCompile counted)
        self._compile_time = None
        self._last = self._read(every_time=True)

    def fill(self, record):
        """Sets ``record``'s counters to what happened since the last call."""
        counts = self.since_last()
        record.compiles, record.cached = counts.compiles, counts.cached
        record.compile_seconds, record.fallbacks = counts.seconds, counts.fallbacks
        record.helper_compiles = counts.helper

    def after_last_step(self, record):
        """Adds to ``record`` (the rank's last step) what the process did after it, until
        the rank's function returned (e.g. ``return loss.item()``)."""
        counts = self.since_last(every_time=True)
        record.compiles += counts.compiles
        record.helper_compiles += counts.helper
        record.cached += counts.cached
        record.compile_seconds += counts.seconds
        for name, count in counts.fallbacks.items():
            record.fallbacks[name] = record.fallbacks.get(name, 0) + count

    def _read(self, every_time=False):
        met = self._met
        with _excused.lock:
            self._deferred = bool(_excused.threads) and self._last is not None
            if self._deferred:
                # A thread is in a helper whose counts are excused: they are told from the
                # others once it returns, so this step's go to a later one.
                compiles, fallbacks = self._last.compiles, self._last.fallbacks
                helper_compiles = self._last.helper
            else:
                compiles = met.counter_value(_COMPILES) or 0
                fallbacks = {
                    name: met.counter_value(name) - _excused.counts[name]
                    for name in met.executed_fallback_ops()
                }
                helper_compiles = _excused.counts[_COMPILES]
        return _Counts(
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
        now, before = self._read(every_time), self._last
        self._last = now
        new_fallbacks = {
            name: _since(count, before.fallbacks.get(name, 0))
            for name, count in now.fallbacks.items()
            if count != before.fallbacks.get(name, 0)
        }
        return _Counts(
            _since(now.compiles, before.compiles),
            _since(now.cached, before.cached),
            now.seconds - before.seconds,
            new_fallbacks,
            now.helper - before.helper,
        )


def _since(now, before):
    """What a counter counted since it read ``before``. torch_xla's dynamo bridge clears
    the counters while it looks for graph breaks (``metrics.clear_counters()`` in
    ``UnsupportedNodesCollector.run_node``, torch_xla/_dynamo/dynamo_bridge.py, v2.8 and
    v2.9) and puts back UncachedCompile's count alone: a counter below its last reading
    was cleared, and counts from zero since."""
    return now - before if now >= before else now


def excused_here():
    """Whether this thread is in an excused helper (``excusing``) now."""
    return bool(getattr(_thread, "excused", 0))
