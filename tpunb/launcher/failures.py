"""What a failed launch is reported as: a rank's error with its likely cause, a process
killed by a signal, a hang with each rank's step and stack. Every message says what
happened and what to do."""

import importlib.util
import signal

from tpunb import errors, simulation
from tpunb.errors import RankError
from tpunb.reports import ranks_named, span
from tpunb.watch import device_memory

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
    "stopped it; use less host memory per core: data built once before the launch, as "
    "tensors, which the fork shares (a dataset of Python objects is copied into every "
    "process that reads it), and smaller batches",
    signal.SIGSEGV: "a crash in native code (torch, torch_xla or a C extension)",
    signal.SIGABRT: "a fatal error in native code, usually torch_xla's runtime, whose "
    "message went to stderr (shown above in a notebook, or in the Jupyter server's log)",
    signal.SIGTERM: "another process asked it to stop",
    signal.SIGBUS: "a memory access fault, often a full /dev/shm",
}

_SIMULATED_ABORT = (
    "on simulated cores this is usually a collective that never completed: XLA waits 10 s "
    "for every rank to join, then aborts. Every rank must reach each collective; one that "
    "stopped or took another path leaves the others waiting (on a TPU they would wait "
    "forever)"
)


def describe(error):
    """In a rank: its exception in words, with the likely cause and the current spelling
    of a removed call where the message shows one."""
    description = f"raised {type(error).__name__}: {error}"
    for symptom, explanation in _KNOWN_CAUSES:
        if symptom in str(error):
            description += f"\n\nLikely cause: {explanation}"
    renamed = errors.hint_for_error(str(error))
    if renamed:
        description += f"\n\n{renamed}"
    return description


def unsendable(result, error):
    """In a rank: its result could not be pickled to go back to the notebook."""
    return (
        f"returned a {type(result).__module__}.{type(result).__qualname__} that cannot be "
        f"sent back to the notebook ({type(error).__name__}: {error}). Return plain data: "
        "numbers, strings, lists, dicts, numpy arrays or tensors (moved to the CPU for you)"
    )


def raised_error(failures, memory=None):
    """``failures``: rank -> messages.Raised; ``memory``: rank -> its device's last
    measured memory (``device_memory.Use``). Reports the lowest failing rank. A rank that
    another rank's end stopped (simulated cores) did not fail: it is named only when no
    rank failed otherwise. How many of those reach the notebook before the launch is
    stopped is a race, so they would make the report differ from run to run."""
    causes = sorted(rank for rank, failure in failures.items() if not failure.consequence)
    failing = causes or sorted(failures)
    first = failing[0]
    failure = failures[first]
    others = failing[1:]
    message = f"rank {first} {failure.description}"
    if device_memory.is_out_of_memory(failure.description):
        cause = device_memory.out_of_memory(first, (memory or {}).get(first))
        message += f"\n\nLikely cause: {cause}"
    if others:
        message += f"\n({ranks_named(others)} failed too)"
    if failure.traceback:
        message += f"\n\nTraceback from rank {first}:\n{failure.traceback.rstrip()}"
    return RankError(message, ranks=failing, remote_traceback=failure.traceback)


def lost_error(missing, exits, rank_pids, simulated, launcher_error):
    """Ranks ``missing`` sent no result. ``exits``: (pid, exit code) of the launch's
    processes; ``rank_pids``: rank -> pid; ``launcher_error``: what the launcher raised."""
    deaths, signals = [], []
    # A process a rank: once one dies, the pool xmp.spawn runs them in stops the others with
    # SIGTERM. The death that was not asked for comes first, and names the signal.
    failed = [(pid, code) for pid, code in exits if code]
    stopped = [(pid, code) for pid, code in failed if code == -signal.SIGTERM]
    if len(stopped) < len(failed):
        failed = [death for death in failed if death not in stopped]
    else:
        stopped = []
    for pid, code in failed:
        ranks = sorted(r for r, p in rank_pids.items() if p == pid)
        named = ranks_named(ranks)
        who = f"the process of {named}" if ranks else "a launch process"
        if code < 0:
            signals.append(signal.Signals(-code).name)
            cause = _SIGNAL_CAUSES.get(-code, "")
            if simulated and -code == signal.SIGABRT:
                cause = _SIMULATED_ABORT
            deaths.append(f"{who} (pid {pid}) was killed by {signals[-1]}: {cause}")
        else:
            deaths.append(f"{who} (pid {pid}) exited with code {code}")
    if stopped:
        ranks = sorted(r for r, p in rank_pids.items() if p in {pid for pid, _ in stopped})
        deaths.append(f"then the processes of ranks {span(ranks)} were stopped (SIGTERM)")
    if deaths:
        reason = "; ".join(deaths)
    elif launcher_error is not None:
        reason = launcher_error
    else:
        reason = "they returned without a result"
    who = f"Rank {missing[0]}" if len(missing) == 1 else f"Ranks {span(missing)}"
    return RankError(
        f"{who} did not finish: {reason}.",
        ranks=missing,
        signal=signals[0] if signals else None,
    )


def hang_error(hang, collectives=None):
    """Groups the running ranks by step and by where they wait; ``collectives``: which
    ranks made more collective calls than others, in words (``collective_calls.Judge.behind``)."""
    groups = {}
    for rank in hang.running:
        groups.setdefault((hang.steps[rank], _where(hang.stacks.get(rank))), []).append(rank)
    lines = [
        f"  {ranks_named(ranks)}: after step {step}, {where}"
        for (step, where), ranks in sorted(groups.items(), key=lambda item: item[1][0])
    ]
    message = (
        f"No rank finished a step for {hang.idle:.0f} s (hang_timeout={hang.timeout}), so the "
        "launch was stopped. A step ends at each torch_xla.sync() (MpDeviceLoader calls it "
        "every batch). Where the ranks were:\n" + "\n".join(lines)
    )
    if collectives:
        message += (
            "\nSome ranks made more collective calls than others, and wait for the others "
            f"to make them:\n{collectives}\nEvery rank must make the same collective calls "
            "in the same order."
        )
    for ranks in groups.values():
        if ranks[0] in hang.stacks:
            message += (
                f"\n\nPython stack of rank {ranks[0]} (most recent call first):\n"
                f"{hang.stacks[ranks[0]]}"
            )
    return RankError(message, ranks=hang.running, stacks=hang.stacks)


def _where(stack):
    """Where a faulthandler stack waits, in words."""
    frames = [
        line.strip() for line in (stack or "").splitlines() if line.strip().startswith("File")
    ]
    if not frames:
        return "no Python stack (inside native code, or the process is gone)"
    innermost = next((f for f in frames if "/threading.py" not in f), frames[0])
    if any(f'"{waits}"' in innermost for waits in _COLLECTIVES):
        return "waiting in a collective for the other ranks"
    return f"in {innermost}"


# Where the simulation's ranks wait for each other, as the simulation names it (found, not
# imported: it imports torch_xla; a rename fails here, at import, instead of silently in a
# hang report).
_COLLECTIVES = [importlib.util.find_spec(name).origin for name in simulation.WAITS_IN]
