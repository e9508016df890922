"""A simulated process keeps the host memory its steps free, for its next steps.

Every step of every rank frees what the last one allocated (graphs' inputs and outputs,
the traced graph's nodes), most of it from the rank thread's own glibc malloc arena. With
glibc's defaults an arena gives the free memory at its top back to the kernel once it
exceeds the trim threshold (``heap_trim`` in glibc's ``malloc/arena.c``), which starts at
128 KiB and follows twice the largest block malloc mapped on its own and freed (the dynamic
mmap threshold, ``malloc/malloc.c``), and the next step touches that memory again: one page
fault a page. On 8 simulated cores that was most of the ranks' process's page faults
(330,000-370,000 against 70,000-75,000 in 4 epochs of ``benchmarks/simulation.py``'s
workload) and about 5% of an epoch, for 50-70 MiB more resident memory
(docs/simulation.md, "The memory a step frees").

So a process that runs simulated ranks keeps up to ``TRIM_BYTES`` free at the top of each
arena, and blocks under ``MMAP_BYTES`` (glibc's own upper bound for its dynamic threshold)
come from the arenas. Set in the ranks' process as its rank threads start, never in the
notebook's. A user's own ``MALLOC_*`` settings (environment or ``GLIBC_TUNABLES``) are
kept. Elsewhere than glibc, nothing changes.
"""

import ctypes
import os

MMAP_BYTES = 32 * 2**20
TRIM_BYTES = 64 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep():
    """Called in a process that runs simulated ranks, before they start: its malloc keeps
    what the steps free. Returns whether the thresholds are set."""
    if not _glibc() or any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))


def _glibc():
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a name this C library knows
        return False
