"""The notebook's side of a launch: starts the launcher in a background thread and watches
the ranks from the calling thread, which stays free to stop everything on the first
failure, a hang or an interrupt. Messages from the ranks (``messages.py``) feed the
history, the compile watch and the live view; the outcome is the results by rank or the
first failure as a ``RankError``."""

from __future__ import annotations

import contextlib
import pickle
import queue
import threading
import time
import warnings
from typing import TYPE_CHECKING

from tpunb import machine
from tpunb.errors import warn
from tpunb.launcher import (
    channel,
    failures,
    heartbeat,
    hooks,
    processes,
    rank,
    watchers,
)
from tpunb.launcher.channel import Ended, Raised, Returned, Steps
from tpunb.watch import collective_calls, compile_watch, history, live

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from tpunb.launcher.launchers import Launcher
    from tpunb.launcher.preflight import Plan
    from tpunb.watch.compile_watch import CompileSummary
    from tpunb.watch.history import History

HANG_CHECK_SECONDS = 0.1
# Python 3.12+ warns at every fork of a process with threads (a notebook kernel always has
# some); xmp.spawn must fork from a notebook (README, "Notebook rules"), so a launch does
# not repeat the warning in every cell.
FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"


class LaunchResults(list):
    """What each rank returned, by rank (a list), with what the launch recorded:
    ``history`` (per rank, per step: logged values, batch shapes, compilations) and
    ``compiles`` (the compilations and their causes, summed up)."""

    def __init__(self, results: Iterable[Any], history: History, compiles: CompileSummary) -> None:
        super().__init__(results)
        self.history = history
        self.compiles = compiles


def supervise(
    plan: Plan,
    launcher: Launcher,
    fn: Callable[..., Any] | None = None,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> LaunchResults:
    """Runs ``launcher`` (a ``launchers.Launcher``) for ``plan`` and watches its ranks; returns a
    ``LaunchResults`` or raises the first failure. ``fn(rank, *args, **kwargs)`` is what
    the ranks run, unless the launcher gives them their work itself (``rank.run(key,
    rank, work)``)."""
    job = rank.Job(
        fn,
        args,
        kwargs or {},
        plan,
        channel.Channel(),
        heartbeat.Heartbeat(plan.cores),
        collective_calls.Ledger(plan.cores),
    )
    key = rank.register(job)
    try:
        hang_timeout = plan.hang_timeout
        stacks = heartbeat.stacks_on_signal() if hang_timeout else contextlib.nullcontext()
        launch_history = history.History(plan.cores)
        watching = watchers.of_launch(job, launch_history)
        with (
            machine.spawn_variables_removed(),
            hooks.installed(plan.checked),
            contextlib.ExitStack() as in_ranks,
            stacks as stacks,
            warnings.catch_warnings(),
        ):
            for watcher in watching.values():
                in_ranks.enter_context(watcher.in_ranks())
            warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
            watchdog = heartbeat.Watchdog(job.heartbeat, hang_timeout, stacks)
            supervisor = _Supervisor(plan, job, key, launcher, watchdog)
            return supervisor.run(launch_history, watching)
    finally:
        job = rank.unregister(key)
        job.heartbeat.close()
        job.ledger.close()


class _Supervisor:
    def __init__(self, plan, job, key, launcher, watchdog):
        self.plan = plan
        self.job = job
        self.key = key
        self.launcher = launcher
        self.watchdog = watchdog
        self.divergence = None
        self.processes = []  # the launch's multiprocessing.Process objects: exit codes
        self.results = {}  # rank -> pickled result
        self.failures = {}  # rank -> Raised
        self.hang = None
        self.ended = None  # the launcher's Ended message
        self.last_warnings = []  # the compile watch's, on the steps judged at the end
        self.stopping = False

    def run(self, launch_history, watching):
        """Starts the launcher and watches the ranks with ``watching`` (name -> watcher),
        their steps kept in ``launch_history``; returns the outcome."""
        self.history = launch_history
        self.watchers = watching
        self.calls = watching.get("collectives")  # the ranks' collective calls, compared
        compiles = watching.get("compiles")
        # Unwatched, the compile watch's summary and the view's panel stay empty.
        unwatched = compile_watch.CompileWatch(self.plan.cores)
        self.compile_watch = compiles.watch if compiles else unwatched
        self.view = live.Guarded(live.view(self.plan.view, self.history, self.compile_watch))
        thread = threading.Thread(target=self._start, name="tpunb-launcher", daemon=True)
        with processes.recording_children(thread) as self.processes:
            self.job.channel.start()
            thread.start()
            try:
                self._watch()
            except KeyboardInterrupt:
                self._stop()
                self._watch()
                raise
            finally:
                if self.ended is None:  # only after a second interrupt
                    self._stop()
                thread.join(5)
                self.job.channel.finish()
                self._read_inbox()
                # Warned only if the launch succeeds; the compile watch judges the last steps
                # here, for the final figure.
                self.last_warnings = [
                    message for watcher in self.watchers.values() for message in watcher.finish()
                ]
                self.view.close(failed=not self._succeeded())
        try:
            return self._outcome()
        finally:
            # An error's traceback keeps this object alive (IPython keeps the last one):
            # let go of the processes, and so of their pipes, now that their exit is read.
            self.processes.clear()

    def _start(self):
        error = None
        try:
            self.launcher.start(self.key)
        except BaseException as raised:  # noqa: BLE001 - reported by _outcome
            error = f"{type(raised).__name__}: {raised}"
            # Its traceback holds the process pool's frames, and they its pipes, in a
            # cycle: without this the pipes stay open until the next garbage collection.
            raised.__traceback__ = None
        finally:
            self.job.channel.inbox.put(Ended(error))  # wakes _watch at once

    def _watch(self):
        inbox = self.job.channel.inbox
        next_check = time.monotonic()
        while self.ended is None:
            try:
                self._handle(inbox.get(timeout=max(0, next_check - time.monotonic())))
            except queue.Empty:
                pass
            self.view.update()
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + HANG_CHECK_SECONDS  # however busy the inbox
            if not self.stopping:
                self.hang = self.watchdog.check()
                for watcher in self.watchers.values():
                    self._warn(watcher.check())
                self.divergence = self.calls.divergence if self.calls else None
                self.stopping = self._failed()  # the first failure stops every rank
            if self.stopping:  # again at each check: processes may still be starting
                processes.kill_trees(self._pids())

    def _handle(self, message):
        if isinstance(message, Steps):
            steps = message.steps()
            self.history.add(message.rank, steps)
            for watcher in self.watchers.values():
                self._warn(watcher.add(message.rank, steps))
        elif isinstance(message, Returned):
            self.results.update(message.results)
        elif isinstance(message, Raised):
            self.failures.setdefault(message.rank, message)
        elif isinstance(message, Ended):
            self.ended = message

    def _read_inbox(self):
        while True:
            try:
                self._handle(self.job.channel.inbox.get_nowait())
            except queue.Empty:
                return

    def _stop(self):
        self.stopping = True
        processes.kill_trees(self._pids())

    def _pids(self):
        # Only live processes: an ended one's pid, once reaped, may already name another.
        return [process.pid for process in self.processes if not processes.ended(process)]

    def _warn(self, messages):
        for message in messages:
            warn(message)

    def _failed(self):
        if self.hang or self.divergence:
            return True
        if not self.failures:
            return False
        if any(not failure.consequence for failure in self.failures.values()):
            return True
        # Only ranks stopped by another's end (simulated cores): the cause is that rank's,
        # known once every rank has ended (its error, its exit, or calls the judge names).
        beat = self.job.heartbeat
        exited = {process.pid for process in self.processes if processes.ended(process)}
        return all(beat.returned(r) or beat.pid(r) in exited for r in range(self.plan.cores))

    def _diverged(self):
        """Whether the ranks took different paths to their collectives, and no rank's own
        error (other than a simulated rank's ``RankEnded``) came first."""
        if self.calls is None or any(not f.consequence for f in self.failures.values()):
            return False
        if self.divergence is None and (self.failures or self.hang):
            self.calls.check(final=True)
            self.divergence = self.calls.divergence
        return self.divergence is not None

    def _succeeded(self):
        return (
            self.hang is None
            and self.divergence is None
            and not self.failures
            and all(r in self.results for r in range(self.plan.cores))
        )

    def _outcome(self):
        # Errors are built in the raise: one kept in self or in a local would sit in a
        # cycle with its traceback's frames, holding the processes' pipes until a gc.
        if self._diverged():
            raise collective_calls.divergence_error(self.divergence)
        if self.hang is not None:
            behind = self.calls.calls.behind(self.hang.running) if self.calls else None
            raise failures.hang_error(self.hang, behind)
        if self.failures:
            raise failures.raised_error(self.failures, self.history.device_memory())
        expected = range(self.plan.cores)
        missing = [r for r in expected if r not in self.results]
        if missing:
            beat = self.job.heartbeat
            raise failures.lost_error(
                missing,
                exits=[(p.pid, p.exitcode) for p in self.processes],  # all joined by now
                rank_pids={r: beat.pid(r) for r in expected if beat.pid(r)},
                simulated=self.plan.simulated,
                launcher_error=self.ended.error if self.ended else None,
            )
        self._warn(self.last_warnings)
        return LaunchResults(
            [pickle.loads(self.results[r]) for r in expected],
            self.history,
            self.compile_watch.summary(),
        )
