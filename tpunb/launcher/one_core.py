"""One rank in a child process of its own (``launch(..., cores=1)``, for debugging).

``xmp.spawn(nprocs=1)`` runs the function in the calling process and starts the XLA
runtime there; in a child of its own, the notebook's process stays clean."""

import functools
import multiprocessing

from tpunb.launcher import rank
from tpunb.launcher.base import Launcher


class OneCore(Launcher):
    def __init__(self):
        super().__init__(cores=1)

    def start(self, key):
        in_a_child_process(functools.partial(rank.run, key))


def in_a_child_process(function, *args):
    """``xmp.spawn(function, args, nprocs=1)`` in a forked child, waited for; returns the
    child's exit code. (Also tpunb.lightning's launcher on one core.)"""
    process = multiprocessing.get_context("fork").Process(
        target=_spawn_one_rank, args=(function, args), name="tpunb-core-0"
    )
    process.start()
    process.join()
    return process.exitcode


def _spawn_one_rank(function, args):
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(function, args=args, nprocs=1, start_method="fork")
