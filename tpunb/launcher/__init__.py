"""The launch: ``launch(fn, *args, **kwargs)`` runs ``fn(rank, *args, **kwargs)`` on every
TPU core from a notebook, through torch_xla's ``xmp.spawn`` with the fork start method,
and returns what every rank returned.

The machinery, one file a responsibility, in the order a launch meets it:

    preflight.py    everything checked before a fork: the Plan (cores, simulated,
                    watchers left out), which the job carries to the ranks
    launchers.py    what starts the ranks: the Launcher interface; XmpSpawn, every core
                    through xmp.spawn(fork), a process a core; OneCore, one rank in a
                    child process (cores=1, debugging)
    supervisor.py   the notebook's side: starts the launcher, reads the ranks' messages
                    into the history, the watchers and the live view, stops everything
                    on the first failure, a hang or an interrupt; the outcome
    watchers.py     what a launch watches, behind one seam (compiles, reads,
                    collectives, memory): each can be left out by name
    rank.py         what runs in each rank: the job's function, its result or error back
    recorder.py     a rank's step records (tpunb.log values, batches, compilations)
    process_counters.py  the process's compile and fallback counters, a step's share
    hooks.py        torch_xla.sync and the loader, wrapped so steps end and batches count
    reads.py        the Tensor methods that read device values, wrapped: does a read cut?
    channel.py      the typed records a rank sends the notebook (Steps, Raised,
                    Returned) and the pipe that carries them, by value
    heartbeat.py    per-rank progress in shared memory, stacks on demand, the watchdog
    failures.py     what a failure is reported as, with its likely cause
    processes.py    the launch's processes: recorded, seen to end, found, killed

What tpunb.lightning uses (its launcher is Lightning's own): ``preflight.checked``,
``preflight.check_runtime_not_started`` (again at fit), ``launchers.Launcher``,
``supervisor.supervise``, ``rank.run`` and, inside a rank, ``recorder.current()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpunb.launcher import preflight
from tpunb.launcher.launchers import OneCore, XmpSpawn
from tpunb.launcher.supervisor import LaunchResults, supervise

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["LaunchResults", "launch"]


def launch(
    fn: Callable[..., Any],
    *args: Any,
    cores: int | None = None,
    hang_timeout: float | None = 600,
    live: str | bool = "auto",
    start_method: str = "fork",
    **kwargs: Any,
) -> LaunchResults:
    """Run ``fn(rank, *args, **kwargs)`` on every TPU core; return the ranks' results by rank.

    ``cores=None`` (or the core count) runs on all cores; ``cores=1`` runs one rank in a
    child process, a debug mode that leaves the notebook's kernel able to launch again.
    When no running rank has finished a step (``torch_xla.sync``) for ``hang_timeout``
    seconds, the launch is stopped and each rank's step and Python stack reported
    (``None``: wait forever). Everything that would break the launch is refused before
    any process starts.

    ``live`` is what the notebook shows meanwhile: ``"auto"`` draws a live figure (values
    given to ``tpunb.log``, samples/s, compilations) under a progress line where the
    notebook draws widgets, and prints a line each epoch elsewhere (nbval, a script);
    ``"widgets"`` and ``"text"`` choose, ``False`` shows nothing. Both end with the
    figure of the whole run.

    Args:
        fn: called as ``fn(rank, *args, **kwargs)`` in each rank.
        cores: None (every core), their count, or 1 (one rank, to debug).
        hang_timeout: seconds without a finished step before the launch is stopped.
        live: ``"auto"``, ``"widgets"``, ``"text"`` or False.
        start_method: ``"fork"`` (what notebooks need; the only one tpunb runs).

    Returns:
        ``LaunchResults``: each rank's result by rank, with ``.history`` and ``.compiles``.
        A failing rank, a hang or ranks that diverged raise ``RankError`` instead.
    """
    plan = preflight.checked(
        cores,
        hang_timeout=hang_timeout,
        view=live,
        start_method=start_method,
        fn=fn,
        args=args,
        kwargs=kwargs,
    )
    launcher = OneCore() if plan.cores == 1 else XmpSpawn(plan.cores)
    return supervise(plan, launcher, fn, args, kwargs)
