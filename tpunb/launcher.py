"""``launch(fn, *args, **kwargs)``: run ``fn(rank, *args, **kwargs)`` on every TPU core from a
notebook, through torch_xla's ``xmp.spawn`` with the fork start method, and return what
every rank returned."""

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import warnings

from tpunb import (
    _channel,
    _fallback_counters,
    _hooks,
    _processes,
    _progress,
    _steps,
    compile_watch,
    hardware,
    history,
    migration,
    platform,
    simulation,
)
from tpunb import live as live_view
from tpunb.errors import RankError, TpunbError, TpunbWarning

# Jobs waiting to run, by key. The forked ranks find their job here (fork copies this
# process's memory), so the function and its arguments are never pickled: functions
# defined in the notebook, closures and lambdas all work.
_jobs = {}
_job_keys = itertools.count()
# In a rank's process: the results of its finished ranks, sent together once all of the
# process's ranks are done (one message, not one a rank, while the others still run).
_finished = []
_finished_lock = threading.Lock()


@dataclasses.dataclass
class _Job:
    fn: object
    args: tuple
    kwargs: dict
    cores: int
    channel: _channel.Channel
    progress: _progress.Progress
    start: float = dataclasses.field(default_factory=time.monotonic)
    # pid -> the rank that reports the process's compilations (torch_xla counts per process)
    compile_reporters: dict = dataclasses.field(default_factory=dict)


class LaunchResults(list):
    """What each rank returned, by rank (a list), with what the launch recorded:
    ``history`` (per rank, per step: logged values, batch shapes, compilations) and
    ``compiles`` (the compilations and their causes, summed up)."""

    def __init__(self, results, history, compiles):
        super().__init__(results)
        self.history = history
        self.compiles = compiles


@dataclasses.dataclass(frozen=True)
class _Plan:
    cores: int  # cores the launch runs on
    simulated: bool


def launch(fn, *args, cores=None, hang_timeout=600, live="auto", start_method="fork", **kwargs):
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
    """
    _check_start_method(start_method)
    _check_callable(fn, args, kwargs)
    _check_hang_timeout(hang_timeout)
    view = live_view.resolve(live)
    plan = _plan(cores)
    _warn_about_worker_processes(plan, args, kwargs)
    spawn = _spawn_one_core if plan.cores == 1 else _spawn_all_cores
    return supervise(plan, spawn, hang_timeout, view, fn, args, kwargs)


def supervise(plan, spawn, hang_timeout, view, fn=None, args=(), kwargs=None):
    """Runs ``spawn(key)`` in a background thread and watches the ranks it starts from
    this one: their steps (history, compile watch, live view), hangs and failures.

    ``spawn`` must start ``plan.cores`` ranks that each call ``_rank_main(key, rank)``
    (which runs ``fn(rank, *args, **kwargs)``) or ``_rank_main(key, rank, run)``.
    """
    key = next(_job_keys)
    progress = _progress.Progress(plan.cores)
    _jobs[key] = _Job(fn, args, kwargs or {}, plan.cores, _channel.Channel(), progress)
    try:
        _fallback_counters.install()  # ranks that are threads fall back together
        stacks = _progress.stacks_on_signal() if hang_timeout else contextlib.nullcontext()
        with _without_spawn_breaking_variables(), _hooks.installed(), stacks as stacks:
            return _Supervisor(plan, key, spawn, hang_timeout, stacks, view).run()
    finally:
        _jobs.pop(key).progress.close()


def _check_start_method(start_method):
    if start_method == "fork":
        return
    why = (
        "In a notebook, spawned processes cannot find the functions defined in it "
        "(https://github.com/pytorch/xla/issues/2750). "
        if platform.in_kernel()
        else ""
    )
    raise TpunbError(
        f"launch(start_method={start_method!r}): tpunb always forks, which is what lets "
        f"functions defined in a notebook, closures and lambdas run on the cores. {why}"
        "Leave start_method out; outside a notebook, call torch_xla's xmp.spawn directly "
        "to use another start method."
    )


def _check_hang_timeout(hang_timeout):
    if hang_timeout is None:
        return
    if (
        isinstance(hang_timeout, bool)
        or not isinstance(hang_timeout, (int, float))
        or hang_timeout <= 0
    ):
        raise TpunbError(
            f"launch(hang_timeout={hang_timeout!r}): give the seconds a launch may go without "
            "any rank finishing a step before it is stopped, e.g. 600, or None to never stop it."
        )


def _warn_about_worker_processes(plan, args, kwargs):
    loaders = [a for a in (*args, *kwargs.values()) if _forks_workers(a)]
    for loader in loaders:
        workers = loader.num_workers
        warnings.warn(
            f"A DataLoader with num_workers={workers} is passed to launch: each of the "
            f"{plan.cores} ranks will fork {workers} worker processes from its own forked "
            f"process ({plan.cores * workers} in all, on {os.cpu_count()} CPUs). Forking a "
            "process whose other threads run XLA can deadlock, and the workers compete "
            "with the ranks for the CPU. For data already in memory use num_workers=0; "
            "otherwise keep ranks x workers within the host's CPUs.",
            TpunbWarning,
            stacklevel=3,
        )


def _forks_workers(obj):
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(obj, data.DataLoader) or obj.num_workers == 0:
        return False
    context = obj.multiprocessing_context
    method = context if isinstance(context, str) or context is None else context.get_start_method()
    return method in (None, "fork")


def _check_callable(fn, args, kwargs):
    if not callable(fn):
        raise TpunbError(
            f"launch(fn, ...) needs a function to run on every core, got {type(fn).__name__} "
            f"{fn!r}. Pass the function itself: tpunb.launch(train, config), not train(...)."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    try:
        signature.bind(0, *args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TpunbError(
            f"{name}{signature} cannot be called as {name}(rank, *args, **kwargs) with the "
            f"arguments given to launch ({error}). The first parameter receives the core's "
            "rank (0, 1, ...), e.g. def train(rank, config): ..."
        ) from None


def _plan(cores):
    """Everything decided and checked before a fork."""
    if importlib.util.find_spec("torch_xla") is None:
        raise TpunbError(
            "torch_xla is not installed. On a TPU VM: pip install torch_xla[tpu]; without a "
            "TPU, for simulated cores: pip install 'tpunb[sim]'."
        )
    _check_runtime_not_started()
    tpu = hardware.detect()
    simulated = simulation.simulated_cores()
    if tpu is None and simulated is None:
        raise TpunbError(
            "No TPU found on this machine, and no simulation is set up. To run on 8 TPU cores "
            "simulated on the CPU, call tpunb.simulate(cores=8) before tpunb.launch(...). "
            "On Colab or Kaggle, pick a TPU runtime/accelerator first."
        )
    available = tpu.cores if tpu is not None else simulated
    if cores is None or cores == available:
        return _Plan(cores=available, simulated=tpu is None)
    if cores == 1 and not isinstance(cores, bool):
        return _Plan(cores=1, simulated=tpu is None)
    where = "simulated cores" if tpu is None else f"cores on this {tpu.accelerator_type}"
    hint = (
        f" To simulate {cores} cores, call tpunb.simulate(cores={cores}) first."
        if tpu is None and isinstance(cores, int) and cores > 1
        else ""
    )
    raise TpunbError(
        f"launch(cores={cores!r}): xmp.spawn runs on all {available} {where} or on 1, "
        f"nothing in between. Use cores=None (all) or cores=1 (debugging).{hint}"
    )


def _check_runtime_not_started():
    if not platform.runtime_started():
        return
    restart = "Restart the kernel" if platform.in_kernel() else "Start a new Python process"
    raise TpunbError(
        "The XLA runtime is already running in this process, so xmp.spawn cannot start the "
        "cores: something here used the XLA device, e.g. torch_xla.device(), "
        "xm.xla_device(), torch_xla.device_count(), xr.world_size() outside a launch, "
        "met.metrics_report(), or a tensor moved to 'xla'. The runtime cannot be stopped. "
        f"{restart}, and touch the device only inside the function you launch."
    )


@contextlib.contextmanager
def _without_spawn_breaking_variables():
    # Kaggle presets TPU_PROCESS_ADDRESSES / CLOUD_TPU_TASK_ID; see platform.py.
    # Removed for the launch only, and put back after.
    saved = platform.spawn_breaking_variables()
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


def _spawn_all_cores(key):
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(functools.partial(_rank_main, key), start_method="fork")


def _spawn_one_core(key):
    # xmp.spawn(nprocs=1) runs the function in the calling process and starts the XLA
    # runtime there; in a child of its own, the notebook's process stays clean.
    process = multiprocessing.get_context("fork").Process(
        target=_run_one_core, args=(key,), name="tpunb-core-0"
    )
    process.start()
    process.join()


def _run_one_core(key):
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(functools.partial(_rank_main, key), nprocs=1)


def _rank_main(key, rank, run=None):
    """Runs in every rank (a thread of a forked process): the user's function (or
    ``run(rank)``), then its result or its error back to the parent."""
    job = _jobs[key]
    if run is None:
        run = functools.partial(_call_user_function, job)
    job.progress.enter(rank)
    reports_compiles = job.compile_reporters.setdefault(os.getpid(), rank) == rank
    recorder = _steps.Recorder(rank, job.channel, job.start, reports_compiles)
    _steps.enter(recorder)
    try:
        try:
            result = run(rank)
            recorder.finish()
        except BaseException as error:  # noqa: BLE001 - everything goes back to the notebook
            # The traceback starts in the user's function, not in this module.
            frames = error.__traceback__
            while frames is not None and frames.tb_frame.f_globals.get("__name__") == __name__:
                frames = frames.tb_next
            remote = traceback.format_exception(type(error), error, frames)
            recorder.flush_finished_steps()  # the history up to the error, for the plots
            job.channel.send(("raised", rank, _describe(error), "".join(remote)))
            return
        try:
            payload = _channel.dumps(result)
        except Exception as error:  # noqa: BLE001
            description = (
                f"returned a {type(result).__module__}.{type(result).__qualname__} that cannot be "
                f"sent back to the notebook ({type(error).__name__}: {error}). Return plain data: "
                "numbers, strings, lists, dicts, numpy arrays or tensors (moved to the CPU for you)"
            )
            job.channel.send(("raised", rank, description, None))
            return
        with _finished_lock:
            _finished.append((rank, payload))
            if len(_finished) == _ranks_in_this_process(job):
                job.channel.send(("returned", list(_finished)))
    finally:
        _steps.leave()
        job.progress.finish(rank)


def _call_user_function(job, rank):
    return job.fn(rank, *job.args, **job.kwargs)


def _ranks_in_this_process(job):
    if job.cores == 1:
        return 1
    import torch_xla.core.xla_model as xm

    return len(xm.get_xla_supported_devices())  # one rank a device, as xmp.spawn runs them


def _describe(error):
    description = f"raised {type(error).__name__}: {error}"
    for symptom, explanation in _KNOWN_CAUSES:
        if symptom in str(error):
            description += f"\n\nLikely cause: {explanation}"
    renamed = migration.hint_for_error(str(error))
    if renamed:
        description += f"\n\n{renamed}"
    return description


# Errors whose message alone does not say what to do.
_KNOWN_CAUSES = [
    (
        "device_ready_queues_",
        (
            "this notebook's process ran a backward pass (loss.backward()) before the launch. "
            "PyTorch's autograd engine starts once per process, and processes forked after "
            "that cannot run backward on XLA devices "
            "(https://github.com/pytorch/xla/issues/4174). "
            "Restart the kernel and run backward passes only inside launched functions."
        ),
    ),
]


# What a signal that killed a rank's process most likely means.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "most likely the host ran out of memory and the kernel's OOM killer "
    "stopped it; use less memory per core (smaller batches, data built once before the "
    "launch so the fork shares it)",
    signal.SIGSEGV: "a crash in native code (torch, torch_xla or a C extension)",
    signal.SIGABRT: "a fatal error in native code, usually torch_xla's runtime, whose "
    "message went to stderr (shown above in a notebook, or in the Jupyter server's log)",
    signal.SIGTERM: "another process asked it to stop",
    signal.SIGBUS: "a memory access fault, often a full /dev/shm",
}


_SIMULATED_ABORT = (
    "on simulated cores this is usually a collective that never completed: XLA waits 10 s "
    "for every rank to join, then aborts. All ranks must reach the collective, build the "
    "same graph from it to the next torch_xla.sync() (no rank-dependent Python numbers in "
    "it, e.g. x * rank: send them as tensors), and read its result (.item(), .cpu(), print) "
    "only after torch_xla.sync()"
)


class _Supervisor:
    """Starts the ranks in a background thread and watches them from the calling thread,
    which stays free to stop everything on the first failure or on an interrupt."""

    def __init__(self, plan, key, spawn, hang_timeout, stacks, view):
        self.plan = plan
        self.key = key
        self.spawn = spawn
        self.hang_timeout = hang_timeout
        self.stacks = stacks
        self.channel = _jobs[key].channel
        self.progress = _jobs[key].progress
        self.hang = None
        self.results = {}
        self.failures = {}  # rank -> (description, remote traceback or None)
        self.processes = []  # the launch's multiprocessing.Process objects: exit codes
        self.stopping = False
        self.spawn_ended = False
        self.spawn_error = None
        self.history = history.History(plan.cores)
        self.compile_watch = compile_watch.CompileWatch(plan.cores)
        self.view_mode = view
        self.view = None

    def run(self):
        spawner = threading.Thread(target=self._spawn, name="tpunb-spawn", daemon=True)
        with _processes.recording_children(spawner) as self.processes:
            view = live_view.view(self.view_mode, self.history, self.compile_watch)
            self.view = live_view.Guarded(view)
            self.channel.start()
            spawner.start()
            try:
                self._watch()
            except KeyboardInterrupt:
                self._stop()
                self._watch()
                raise
            finally:
                if not self.spawn_ended:  # only after a second interrupt
                    self._stop()
                spawner.join(5)
                self.channel.finish()
                self._read_inbox()
                self.view.close(failed=not self._succeeded())
        try:
            return self._outcome()
        finally:
            # An error's traceback keeps this object alive (IPython keeps the last one):
            # let go of the processes, and so of their pipes, now that their exit is read.
            self.processes.clear()

    def _spawn(self):
        try:
            self.spawn(self.key)
        except BaseException as error:  # noqa: BLE001 - reported by _outcome
            self.spawn_error = f"{type(error).__name__}: {error}"
            # Its traceback holds the process pool's frames, and they its pipes, in a
            # cycle: without this the pipes stay open until the next garbage collection.
            error.__traceback__ = None
        finally:
            self.channel.inbox.put(("spawn ended",))  # wakes _watch at once

    def _watch(self):
        next_check = time.monotonic()
        while not self.spawn_ended:
            try:
                self._handle(self.channel.inbox.get(timeout=max(0, next_check - time.monotonic())))
            except queue.Empty:
                pass
            self.view.update()
            if time.monotonic() >= next_check:  # on the clock, however busy the inbox
                self._check_for_hang()
                next_check = time.monotonic() + 0.1
            if self.failures:  # the first failure stops every rank
                self.stopping = True
            if self.stopping:  # again on every turn: processes may still be starting
                _processes.kill_trees(self._pids())

    def _stop(self):
        self.stopping = True
        _processes.kill_trees(self._pids())

    def _pids(self):
        # Only processes not yet reaped: a reaped one's pid may already name another.
        return [process.pid for process in self.processes if process.exitcode is None]

    def _rank_pids(self):
        pids = {rank: self.progress.pid(rank) for rank in range(self.plan.cores)}
        return {rank: pid for rank, pid in pids.items() if pid}

    def _read_inbox(self):
        while True:
            try:
                self._handle(self.channel.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, message):
        kind = message[0]
        if kind == "spawn ended":
            self.spawn_ended = True
        elif kind == "raised":
            self.failures.setdefault(message[1], (message[2], message[3]))
        elif kind == "returned":
            self.results.update(message[1])
        elif kind == "steps":
            self.history.add(message[1], message[2])
            self._warn(self.compile_watch.add(message[1], message[2]))

    def _warn(self, messages):
        for message in messages:
            warnings.warn(message, TpunbWarning, stacklevel=_outside_tpunb())

    def _check_for_hang(self):
        if self.hang_timeout is None or self.stopping:
            return
        running = [r for r in range(self.plan.cores) if not self.progress.finished(r)]
        idle = self.progress.idle_seconds(running) if running else 0
        if idle < self.hang_timeout:
            return
        stacks = _progress.collect_stacks(self.stacks, self.progress, running)
        steps = {rank: self.progress.step(rank) for rank in running}
        self.hang = (running, steps, stacks, idle, self.hang_timeout)
        self._stop()

    def _succeeded(self):
        return (
            self.hang is None
            and not self.failures
            and all(rank in self.results for rank in range(self.plan.cores))
        )

    def _outcome(self):
        # Errors are built in the raise: one kept in self or in a local would sit in a
        # cycle with its traceback's frames, holding the processes' pipes until a gc.
        if self.hang is not None:
            raise _hang_error(*self.hang)
        if self.failures:
            raise _raised_error(self.failures)
        expected = range(self.plan.cores)
        missing = [rank for rank in expected if rank not in self.results]
        if missing:
            raise self._lost_error(missing)
        self._warn(self.compile_watch.finish())
        return LaunchResults(
            [pickle.loads(self.results[rank]) for rank in expected],
            self.history,
            self.compile_watch.summary(),
        )

    def _lost_error(self, missing):
        deaths, signals = [], []
        for process in self.processes:
            pid, code = process.pid, process.exitcode
            if not code:
                continue
            ranks = sorted(r for r, p in self._rank_pids().items() if p == pid)
            who = f"the process of ranks {_span(ranks)}" if ranks else "a launch process"
            if code < 0:
                signals.append(signal.Signals(-code).name)
                cause = _SIGNAL_CAUSES.get(-code, "")
                if self.plan.simulated and -code == signal.SIGABRT:
                    cause = _SIMULATED_ABORT
                deaths.append(f"{who} (pid {pid}) was killed by {signals[-1]}: {cause}")
            else:
                deaths.append(f"{who} (pid {pid}) exited with code {code}")
        if deaths:
            reason = "; ".join(deaths)
        elif self.spawn_error is not None:
            reason = self.spawn_error
        else:
            reason = "they returned without a result"
        return RankError(
            f"Ranks {_span(missing)} did not finish: {reason}.",
            ranks=missing,
            signal=signals[0] if signals else None,
        )


def _outside_tpunb():
    """The ``stacklevel`` that shows a warning at the user's line calling tpunb (the
    launch), not inside tpunb."""
    frame, level = sys._getframe(1), 1  # stacklevel 1: the function calling warnings.warn
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "tpunb":
        frame, level = frame.f_back, level + 1
    return level


def _hang_error(running, steps, stacks, idle, hang_timeout):
    """Groups the running ranks by step and by where they wait."""
    groups = {}
    for rank in running:
        groups.setdefault((steps[rank], _where(stacks.get(rank))), []).append(rank)
    lines = [
        f"  {'rank' if len(ranks) == 1 else 'ranks'} {_span(ranks)}: after step {step}, {where}"
        for (step, where), ranks in sorted(groups.items(), key=lambda item: item[1][0])
    ]
    message = (
        f"No rank finished a step for {idle:.0f} s (hang_timeout={hang_timeout}), so the "
        "launch was stopped. A step ends at each torch_xla.sync() (MpDeviceLoader calls it "
        "every batch). Where the ranks were:\n" + "\n".join(lines)
    )
    for ranks in groups.values():
        if ranks[0] in stacks:
            message += (
                f"\n\nPython stack of rank {ranks[0]} (most recent call first):\n{stacks[ranks[0]]}"
            )
    return RankError(message, ranks=running, stacks=stacks)


def _where(stack):
    """Where a faulthandler stack waits, in words."""
    frames = [
        line.strip() for line in (stack or "").splitlines() if line.strip().startswith("File")
    ]
    if not frames:
        return "no Python stack (inside native code, or the process is gone)"
    innermost = next((f for f in frames if "/threading.py" not in f), frames[0])
    if "tpunb/_cpu_collectives.py" in innermost:
        return "waiting in a collective for the other ranks"
    return f"in {innermost}"


def _raised_error(failures):
    first = min(failures)
    description, remote = failures[first]
    others = sorted(set(failures) - {first})
    message = f"rank {first} {description}"
    if others:
        message += f"\n(ranks {_span(others)} failed too)"
    if remote:
        message += f"\n\nTraceback from rank {first}:\n{remote.rstrip()}"
    return RankError(message, ranks=sorted(failures), remote_traceback=remote)


def _span(ranks):
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
