"""The launch's child processes: finding them, their descendants, and stopping them (Linux /proc)."""

import os
import signal


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
