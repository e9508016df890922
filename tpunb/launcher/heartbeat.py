"""The hang watchdog: how far each rank got (steps, i.e. ``torch_xla.sync`` calls, the time
of the last one, the rank's process and thread) in memory shared with the forked ranks,
their Python stacks on demand (faulthandler), and the check that stops a launch once no
running rank has finished a step for ``hang_timeout`` seconds."""

import contextlib
import faulthandler
import mmap
import os
import re
import signal
import tempfile
import threading
import time
import typing

STACKS_SIGNAL = signal.SIGUSR1
_STEPS, _TIME, _PID, _THREAD, _DONE, _SLOTS = range(6)
_rank = threading.local()  # in a rank's thread: (Heartbeat, rank)


_RUNNING, _RETURNED, _FINISHED = 0, 1, 2  # a rank's state (_DONE slot)


class Heartbeat:
    """Per rank: steps done, the monotonic time of the last one, its pid and thread id,
    and whether its function returned and it finished. Created before the fork (an
    anonymous shared mapping: no file descriptor), written by the ranks, read by the
    parent and by the rank that reports its process's compilations."""

    def __init__(self, ranks):
        self.ranks = ranks
        self._memory = mmap.mmap(-1, 8 * _SLOTS * ranks)
        self._values = memoryview(self._memory).cast("d")
        now = time.monotonic()
        for rank in range(ranks):
            self._values[_SLOTS * rank + _TIME] = now

    def step(self, rank):
        return int(self._values[_SLOTS * rank + _STEPS])

    def pid(self, rank):
        """The rank's process id, or None before the rank started."""
        return int(self._values[_SLOTS * rank + _PID]) or None

    def thread(self, rank):
        return int(self._values[_SLOTS * rank + _THREAD])

    def finished(self, rank):
        return self._values[_SLOTS * rank + _DONE] == _FINISHED

    def returned(self, rank):
        """True once the rank's function returned or raised (its result is being sent)."""
        return self._values[_SLOTS * rank + _DONE] >= _RETURNED

    def idle_seconds(self, ranks):
        """Seconds since the most recent progress of any of ``ranks``."""
        return time.monotonic() - max(self._values[_SLOTS * r + _TIME] for r in ranks)

    def enter(self, rank):
        """Called first in each rank's thread."""
        base = _SLOTS * rank
        # Thread ids are addresses below 2**48: exact in a double.
        self._values[base + _PID] = os.getpid()
        self._values[base + _THREAD] = threading.get_ident()
        self._values[base + _TIME] = time.monotonic()
        _rank.current = (self, rank)

    def function_returned(self, rank):
        """Called in a rank's thread once its function returned or raised."""
        self._values[_SLOTS * rank + _DONE] = _RETURNED

    def finish(self, rank):
        """Called last in each rank's thread, whether it returned or raised."""
        self._values[_SLOTS * rank + _DONE] = _FINISHED
        _rank.current = None

    def close(self):
        self._values.release()
        self._memory.close()


class Hang(typing.NamedTuple):
    """A launch stopped as hung."""

    running: list  # ranks that had not finished
    steps: dict  # rank -> steps it had done
    stacks: dict  # rank -> its Python stack, most recent call first
    idle: float  # seconds without any running rank finishing a step
    timeout: float  # the launch's hang_timeout


class Watchdog:
    """In the notebook: ``check()`` returns a ``Hang`` once no running rank has finished a
    step for ``timeout`` seconds (never with ``timeout=None``)."""

    def __init__(self, heartbeat, timeout, stacks):
        self.heartbeat = heartbeat
        self.timeout = timeout
        self.stacks = stacks  # the file the ranks dump their stacks to (stacks_on_signal)

    def check(self):
        if self.timeout is None:
            return None
        beat = self.heartbeat
        running = [r for r in range(beat.ranks) if not beat.finished(r)]
        idle = beat.idle_seconds(running) if running else 0
        if idle < self.timeout:
            return None
        stacks = collect_stacks(self.stacks, beat, running)
        return Hang(running, {r: beat.step(r) for r in running}, stacks, idle, self.timeout)


def tick():
    """Called after each ``torch_xla.sync()`` in a rank's thread."""
    current = getattr(_rank, "current", None)
    if current is not None:
        progress, rank = current
        progress._values[_SLOTS * rank + _STEPS] += 1
        progress._values[_SLOTS * rank + _TIME] = time.monotonic()


@contextlib.contextmanager
def stacks_on_signal():
    """For the duration of a launch, in the parent: the stacks signal makes a process dump
    its threads' Python stacks to the yielded file. The fork hands it to the ranks."""
    with tempfile.TemporaryFile("w+b") as stacks:
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
        try:
            yield stacks
        finally:
            faulthandler.unregister(STACKS_SIGNAL)


def collect_stacks(stacks, progress, ranks, wait=0.3):
    """Asks the processes of ``ranks``, one at a time, for their threads' Python stacks;
    returns {rank: stack text, most recent call first}."""
    by_thread = {(progress.pid(r), progress.thread(r)): r for r in ranks if progress.pid(r)}
    found = {}
    for pid in sorted({pid for pid, _ in by_thread}):
        start = os.fstat(stacks.fileno()).st_size
        try:
            os.kill(pid, STACKS_SIGNAL)
        except ProcessLookupError:
            continue
        time.sleep(wait)
        end = os.fstat(stacks.fileno()).st_size
        text = os.pread(stacks.fileno(), end - start, start).decode(errors="replace")
        for thread, body in _threads(text):
            if (pid, thread) in by_thread:
                found[by_thread[pid, thread]] = body
    return found


def _threads(text):
    # faulthandler: 'Thread 0x00007f... (most recent call first):' then '  File ...' lines.
    parts = re.split(
        r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):\n", text, flags=re.M
    )
    for ident, body in zip(parts[1::2], parts[2::2], strict=True):
        yield int(ident, 16), body.rstrip("\n")
