"""What runs in every rank (a forked process a core): the job's function, then its result
or its error back to the notebook.

Jobs wait here by key. The forked ranks find their job in this module (fork copies the
notebook's memory), so the function and its arguments are never pickled: functions
defined in the notebook, closures and lambdas all work."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import TYPE_CHECKING

from tpunb import program_lines
from tpunb.errors import CollectiveMismatch, RankEnded
from tpunb.launcher import channel, failures, heartbeat, recorder
from tpunb.launcher.channel import Raised, Returned
from tpunb.watch import collective_calls

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from tpunb.launcher.preflight import Plan

_jobs = {}
_keys = itertools.count()


@dataclasses.dataclass
class Job:
    """A launch, as its ranks see it: what to run and where to report."""

    fn: object  # called as fn(rank, *args, **kwargs)
    args: tuple
    kwargs: dict
    plan: Plan  # the cores, and the watchers left out
    channel: channel.Channel
    heartbeat: heartbeat.Heartbeat
    ledger: collective_calls.Ledger  # each rank's collective calls
    start: float = dataclasses.field(default_factory=time.monotonic)


def register(job: Job) -> int:
    """Makes ``job`` findable by the ranks forked from now on; returns its key."""
    key = next(_keys)
    _jobs[key] = job
    return key


def unregister(key: int) -> Job:
    return _jobs.pop(key)


def launching() -> bool:
    """Whether a ``tpunb.launch`` is under way in this process (its ranks are its own)."""
    return bool(_jobs)


def registered(key: int) -> Job:
    """The registered job ``key``: what its launcher hands its ranks."""
    return _jobs[key]


def run(key: int, rank: int, work: Callable[[int], Any] | None = None) -> None:
    """The entry of every rank of job ``key``: runs ``fn(rank, *args, **kwargs)`` (or
    ``work(rank)``), recording its steps, then sends its result or error to the notebook."""
    job = _jobs[key]
    if work is None:
        work = functools.partial(_call_function, job)
    job.heartbeat.enter(rank)
    plan = job.plan
    recording = recorder.Recorder(
        rank,
        job.channel,
        job.start,
        plan.watches("compiles"),
        job.ledger if plan.cores > 1 and plan.watches("collectives") else None,
        memory=plan.watches("memory"),
        split_syncs=plan.watches("reads"),
    )
    recorder.enter(recording)
    try:
        try:
            try:
                result = work(rank)
                job.ledger.returned(rank)
            finally:
                job.heartbeat.function_returned(rank)
            recording.finish()
        except BaseException as error:  # noqa: BLE001 - everything goes back to the notebook
            # The traceback starts in the user's function, not in this module.
            frames = error.__traceback__
            while frames is not None and frames.tb_frame.f_globals.get("__name__") == __name__:
                frames = frames.tb_next
            remote = program_lines.formatted_traceback(error, frames)
            recording.flush_finished_steps()  # the history up to the error, for the plots
            # Stopped, on simulated cores, by the end of a rank it waited for, or by the
            # simulation's verdict on the ranks' calls: the launch reports the cause.
            stopped = isinstance(error, (RankEnded, CollectiveMismatch))
            job.channel.send(Raised(rank, failures.describe(error), "".join(remote), stopped))
            return
        try:
            payload = channel.dumps(result)
        except Exception as error:  # noqa: BLE001
            job.channel.send(Raised(rank, failures.unsendable(result, error), None))
            return
        job.channel.send(Returned([(rank, payload)]))
    finally:
        recorder.leave()
        job.heartbeat.finish(rank)


def _call_function(job, rank):
    return job.fn(rank, *job.args, **job.kwargs)
