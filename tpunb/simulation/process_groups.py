"""torch.distributed's default process group, one per simulated core.

Used only under ``tpunb.simulate``. ``torch.distributed`` keeps the default process group
in one object per process (``distributed_c10d._world``). On a v5e-8 each rank is a process
of its own, so each has its own; on the simulation the ranks are threads of one process,
and the first rank's ``init_process_group`` would become every rank's group
(``dist.get_rank()`` would say 5 on all eight). Here each rank gets its own default group,
found from the core the calling thread works on, so it is also found from the threads in
which autograd runs a rank's backward (DDP's hooks). The maps keyed by group stay shared,
as each rank's group is a distinct object there.
"""

import os

import torch.distributed.distributed_c10d as c10d

from tpunb.machine import cores


class WorldOfEachRank:
    """``distributed_c10d._world`` with a default group for each rank."""

    def __init__(self, process_world):
        self._process_world = process_world
        self._rank_worlds = {}

    def _world(self):
        if not cores.in_rank():
            return self._process_world
        import torch_xla.runtime as xr

        key = (os.getpid(), xr.global_ordinal())
        world = self._rank_worlds.get(key)
        if world is None:
            world = self._rank_worlds.setdefault(key, c10d._World())
        return world

    @property
    def default_pg(self):
        return self._world().default_pg

    @default_pg.setter
    def default_pg(self, value):
        self._world().default_pg = value

    @property
    def pg_coalesce_state(self):
        return self._world().pg_coalesce_state

    @property
    def group_count(self):
        return self._process_world.group_count

    @group_count.setter
    def group_count(self, value):
        self._process_world.group_count = value

    def __getattr__(self, name):
        return getattr(self._process_world, name)


def world_of_each_rank(_, world):
    """The registry's maker for ``distributed_c10d._world``."""
    return WorldOfEachRank(world)
