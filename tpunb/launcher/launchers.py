"""What starts the ranks of a launch: one small interface (``Launcher``) and its two
mechanisms, every core through torch_xla's ``xmp.spawn`` with the fork start method
(``XmpSpawn``), or one rank in a child process of its own (``OneCore``); tpunb.lightning
brings Lightning's own XLA launcher.

``xmp.spawn(nprocs=1)`` runs the function in the calling process and starts the XLA
runtime there; in a child of its own, the notebook's process stays clean."""

from __future__ import annotations

import abc
import functools
import multiprocessing

from tpunb.launcher import rank


class Launcher(abc.ABC):
    """Starts ``cores`` ranks, each of which calls ``tpunb.launcher.rank.run(key, rank)``,
    and returns once all of them have ended. ``start`` runs in a background thread of the
    notebook's process: it may block; the supervisor watches the ranks meanwhile."""

    def __init__(self, cores: int) -> None:
        self.cores = cores

    @abc.abstractmethod
    def start(self, key: int) -> None:
        """Starts the ranks of the job ``key`` and waits for them."""


class XmpSpawn(Launcher):
    """One process a core, as on a v5e-8 (and on the simulated cores)."""

    def start(self, key: int) -> None:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(functools.partial(rank.run, key), start_method="fork")


class OneCore(Launcher):
    """One rank in a child process of its own (``launch(..., cores=1)``, for debugging)."""

    def __init__(self) -> None:
        super().__init__(cores=1)

    def start(self, key: int) -> None:
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
