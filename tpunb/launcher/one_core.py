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
        process = multiprocessing.get_context("fork").Process(
            target=_run, args=(key,), name="tpunb-core-0"
        )
        process.start()
        process.join()


def _run(key):
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(functools.partial(rank.run, key), nprocs=1)
