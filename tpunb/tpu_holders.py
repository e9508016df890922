"""Which processes hold this host's TPU: its device files open, or libtpu's lock taken.

libtpu lets one process at a time use the TPU: it takes a lock on ``/tmp/libtpu_lockfile``
and keeps the chips' device files open until the process exits (openxla/xla,
xla/stream_executor/tpu/tpu_initializer_helper.cc, whose error names the pid: "The TPU is
already in use by process with pid ..."). Ranks left running by an interrupted
``xmp.spawn`` hold both (https://github.com/pytorch/xla/issues/7974), and every launch
after them fails until they end. Reads /proc only: nothing is locked or opened here.
"""

from __future__ import annotations

import dataclasses
import glob
import os

# A TPU's chips: /dev/accel<N> up to v4, /dev/vfio/<N> from v5e on (gVisor's TPU proxy,
# pkg/sentry/devices/tpuproxy, matches them so).
DEVICE_FILES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
LOCK_FILE = "/tmp/libtpu_lockfile"


@dataclasses.dataclass(frozen=True)
class Holder:
    """A process that holds the TPU, and what of it."""

    pid: int
    command: str
    holds: tuple  # device files it has open, and the lock file if it holds the lock

    def describe(self):
        return f"pid {self.pid} ({self.command}) holds {', '.join(self.holds)}"


def find(
    device_files: tuple = DEVICE_FILES, lock_file: str = LOCK_FILE, proc: str = "/proc"
) -> list[Holder]:
    """The processes other than this one that hold a TPU device file or libtpu's lock.

    Args:
        device_files: glob patterns of the TPU's device files.
        lock_file: libtpu's lock file.
        proc: where Linux lists the processes.

    Returns:
        A ``Holder`` for each such process, by pid; empty when the TPU is free (or this
        host has none).
    """
    files = {}  # (st_dev, st_ino) -> path
    for pattern in device_files:
        for path in glob.glob(pattern):
            files[_identity(path)] = path
    files.pop(None, None)
    devices = {}  # pid -> the device files it has open
    if files:
        for pid in _pids(proc):
            for fd in _listdir(f"{proc}/{pid}/fd"):
                path = files.get(_identity(f"{proc}/{pid}/fd/{fd}"))
                if path is not None:
                    devices.setdefault(pid, set()).add(path)
    lockers = set(_lock_holders(lock_file, proc))
    return [
        Holder(
            pid,
            _command(pid, proc),
            tuple(sorted(devices.get(pid, ()))) + ((lock_file,) if pid in lockers else ()),
        )
        for pid in sorted(set(devices) | lockers)
        if pid != os.getpid()
    ]


def described(holders) -> str:
    """Who holds the TPU, and what of it, in a line."""
    return "; ".join(holder.describe() for holder in holders)


def advice(holders: list[Holder]) -> str:
    """What to tell a user whose TPU is held: who holds it, and how to free it."""
    pids = " ".join(str(holder.pid) for holder in holders)
    return (
        "The TPU is held by another process: "
        + described(holders)
        + ". A launch here would fail (libtpu: 'The TPU is already in use by process with "
        "pid ...'). If these are ranks left by an interrupted launch "
        f"(pytorch/xla #7974), end them in a cell: !kill -9 {pids}; then tpunb.env() shows "
        "the TPU free. Otherwise wait for that job, or restart the session."
    )


def _identity(path):
    """What a path is, following links: (device, inode), or None where it cannot be read."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _lock_holders(lock_file, proc):
    """The pids that hold a POSIX lock (libtpu takes one with lockf) on the lock file."""
    identity = _identity(lock_file)
    if identity is None:
        return []
    device, inode = identity
    pids = []
    try:
        with open(f"{proc}/locks") as locks:
            lines = locks.readlines()
    except OSError:
        return []
    for line in lines:
        # "1: POSIX  ADVISORY  WRITE 12345 08:01:1234567 0 EOF": pid, then major:minor:inode
        fields = line.split()
        if len(fields) < 6 or fields[1] not in ("POSIX", "OFDLCK") or fields[4] == "-1":
            continue
        major, minor, number = fields[5].split(":")
        if int(number) == inode and os.makedev(int(major, 16), int(minor, 16)) == device:
            pids.append(int(fields[4]))
    return pids


def _pids(proc):
    return [int(name) for name in _listdir(proc) if name.isdigit()]


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:  # the process ended, or it is another user's
        return []


def _command(pid, proc):
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
    except OSError:
        return "ended"
    command = " ".join(word.decode(errors="replace") for word in words if word)
    return command if len(command) <= 80 else command[:77] + "..."
