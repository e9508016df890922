"""Every core: torch_xla's ``xmp.spawn`` with the fork start method, as on a TPU."""

import functools

from tpunb.launcher import rank
from tpunb.launcher.base import Launcher


class XmpSpawn(Launcher):
    """One process a core, as on a v5e-8 (and on the simulated cores)."""

    def start(self, key):
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(functools.partial(rank.run, key), start_method="fork")
