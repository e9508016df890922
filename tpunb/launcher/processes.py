"""The launch's child processes: recording them, seeing them end (without reaping them),
finding their descendants (Linux /proc), and stopping them."""

import contextlib
import os
import signal
import threading

from tpunb.upstream import registry


def descendants(pid):
    """All live descendants of ``pid`` (children, grandchildren, ...)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent_pid(entry)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def ended(process):
    """Whether the started ``multiprocessing.Process`` has ended: exited, or reaped already.
    Asked with ``waitid``'s WNOWAIT, which leaves it to be reaped by the thread that joins it
    (ProcessPoolExecutor's, in ``xmp.spawn``): a ``process.exitcode`` read here could reap it
    first, and that join would then return without the exit code and leave the process, and
    its two pipes, in multiprocessing's set of children (cpython #130895). (Its sentinel
    would not do: a process it forked keeps that pipe open after it ends.)"""
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, process.pid, flags) is not None
    except ChildProcessError:  # reaped already
        return True


def kill_trees(pids):
    """SIGKILL each process in ``pids`` and all of its descendants."""
    for pid in pids:
        for victim in [pid, *descendants(pid)]:
            try:
                os.kill(victim, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _parent_pid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return int(stat.rpartition(")")[2].split()[1])


@contextlib.contextmanager
def recording_children(starter):
    """Yields a list that receives every ``multiprocessing.Process`` the thread ``starter``
    starts while inside, so their exit codes (the signal that killed one) stay readable.

    ``xmp.spawn`` starts its processes through a ProcessPoolExecutor, which neither
    exposes them nor reports how they died, and reaps them itself. The only hook is the
    set in which multiprocessing registers each started process; it is swapped for a
    recording one here and put back, with its members, on the way out.
    """
    started = []
    with registry.during("launch_started_processes", starter, started):
        yield started


def recording(_, children, starter, started):
    """The registry's maker: multiprocessing's set of started processes, which also puts
    those that the thread ``starter`` starts in ``started``. What it gains and loses, the
    set it replaced does too, so putting that back loses no process."""

    class Recording(set):
        def add(self, process):
            if threading.current_thread() is starter:
                started.append(process)
            super().add(process)
            children.add(process)

        def discard(self, process):
            super().discard(process)
            children.discard(process)

    return Recording(children)
