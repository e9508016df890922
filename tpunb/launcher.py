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
import queue
import signal
import sys
import pickle
import threading
import traceback

from tpunb import _channel, _processes, hardware, platform, simulation
from tpunb.errors import RankError, TpunbError

# Jobs waiting to run, by key. The forked ranks find their job here (fork copies this
# process's memory), so the function and its arguments are never pickled: functions
# defined in the notebook, closures and lambdas all work.
_jobs = {}
_job_keys = itertools.count()


@dataclasses.dataclass
class _Job:
    fn: object
    args: tuple
    kwargs: dict
    channel: _channel.Channel


@dataclasses.dataclass(frozen=True)
class _Plan:
    cores: int  # cores the launch runs on
    available: int  # cores of the TPU, real or simulated
    simulated: bool


def launch(fn, *args, cores=None, **kwargs):
    """Run ``fn(rank, *args, **kwargs)`` on every TPU core; return the ranks' results by rank.

    ``cores=None`` (or the core count) runs on all cores; ``cores=1`` runs one rank in a
    child process, a debug mode that leaves the notebook's kernel able to launch again.
    Everything that would break the launch is refused before any process starts.
    """
    _check_callable(fn, args, kwargs)
    plan = _plan(cores)
    key = next(_job_keys)
    _jobs[key] = _Job(fn, args, kwargs, _channel.Channel())
    try:
        with _without_spawn_breaking_variables():
            return _Supervisor(plan, key).run()
    finally:
        del _jobs[key]


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
        return _Plan(cores=available, available=available, simulated=tpu is None)
    if cores == 1 and not isinstance(cores, bool):
        return _Plan(cores=1, available=available, simulated=tpu is None)
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
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None or not torch_xla._XLAC._xla_runtime_is_initialized():
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


def _rank_main(key, rank):
    """Runs in every rank (a thread of a forked process): the user's function, then its
    result or its error back to the parent."""
    job = _jobs[key]
    job.channel.send(("started", rank, os.getpid()))
    try:
        result = job.fn(rank, *job.args, **job.kwargs)
    except BaseException as error:  # noqa: BLE001 - everything goes back to the notebook
        # The traceback starts in the user's function, not in this wrapper.
        remote = traceback.format_exception(type(error), error, error.__traceback__.tb_next)
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
    job.channel.send(("returned", rank, payload))


def _describe(error):
    description = f"raised {type(error).__name__}: {error}"
    for symptom, explanation in _KNOWN_CAUSES:
        if symptom in str(error):
            description += f"\n\nLikely cause: {explanation}"
    return description


# Errors whose message alone does not say what to do.
_KNOWN_CAUSES = [
    (
        "device_ready_queues_",
        "this notebook's process ran a backward pass (loss.backward()) before the launch. "
        "PyTorch's autograd engine starts once per process, and processes forked after that "
        "cannot run backward on XLA devices (https://github.com/pytorch/xla/issues/4174). "
        "Restart the kernel and run backward passes only inside launched functions.",
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
    "for every rank to join, then aborts. Every rank must build the same graph around a "
    "collective (no rank-dependent Python numbers in it, e.g. torch.full(..., rank) or "
    "x * rank: send them as tensors), all ranks must reach it, and its result must be "
    "read (.item(), .cpu(), print) only after torch_xla.sync()"
)


class _Supervisor:
    """Starts the ranks in a background thread and watches them from the calling thread,
    which stays free to stop everything on the first failure or on an interrupt."""

    def __init__(self, plan, key):
        self.plan = plan
        self.key = key
        self.channel = _jobs[key].channel
        self.results = {}
        self.failures = {}  # rank -> (description, remote traceback or None)
        self.rank_pids = {}
        self.processes = {}  # pid -> multiprocessing.Process, to read exit codes
        self.stopping = False
        self.spawn_ended = False
        self.spawn_error = None
        # Children the notebook had before this launch are never ours to stop.
        self.foreign = {process.pid for process in multiprocessing.active_children()}

    def run(self):
        spawn = _spawn_one_core if self.plan.cores == 1 else _spawn_all_cores
        spawner = threading.Thread(target=self._spawn, args=(spawn,), name="tpunb-spawn", daemon=True)
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
            self._track_children()
            self.channel.finish()
            self._read_inbox()
        return self._outcome()

    def _spawn(self, spawn):
        try:
            spawn(self.key)
        except BaseException as error:  # noqa: BLE001 - reported by _outcome
            self.spawn_error = error
        finally:
            self.channel.inbox.put(("spawn ended", None))  # wakes _watch at once

    def _watch(self):
        while not self.spawn_ended:
            try:
                self._handle(self.channel.inbox.get(timeout=0.1))
            except queue.Empty:
                self._track_children()
            if self.failures and not self.stopping:
                self._stop()
            if self.stopping:
                _processes.kill_trees(self._pids())

    def _stop(self):
        self.stopping = True
        _processes.kill_trees(self._pids())

    def _pids(self):
        return set(self.processes) | set(self.rank_pids.values())

    def _track_children(self):
        for process in multiprocessing.active_children():
            if process.pid not in self.foreign:
                self.processes.setdefault(process.pid, process)

    def _read_inbox(self):
        while True:
            try:
                self._handle(self.channel.inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, message):
        kind, rank = message[0], message[1]
        if kind == "spawn ended":
            self.spawn_ended = True
        elif kind == "started":
            self.rank_pids[rank] = message[2]
            if message[2] not in self.processes:
                self._track_children()
        elif kind == "raised":
            self.failures.setdefault(rank, (message[2], message[3]))
        elif kind == "returned":
            self.results[rank] = message[2]

    def _outcome(self):
        if self.failures:
            raise _raised_error(self.failures)
        expected = range(self.plan.cores)
        missing = [rank for rank in expected if rank not in self.results]
        if missing:
            raise self._lost_error(missing)
        return [pickle.loads(self.results[rank]) for rank in expected]

    def _lost_error(self, missing):
        deaths, signals = [], []
        for pid, process in sorted(self.processes.items()):
            code = process.exitcode
            if not code:
                continue
            ranks = sorted(r for r, p in self.rank_pids.items() if p == pid)
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
            reason = f"{type(self.spawn_error).__name__}: {self.spawn_error}"
        else:
            reason = "they returned without a result"
        return RankError(
            f"Ranks {_span(missing)} did not finish: {reason}.",
            ranks=missing,
            signal=signals[0] if signals else None,
        )


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
