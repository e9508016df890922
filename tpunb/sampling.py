"""``shard(loader)``: inside a rank, the per-core version of a DataLoader built in the
notebook, with the DistributedSampler torch_xla users must otherwise remember to add
(the sampler insertion Lightning does for its users)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from tpunb import machine
from tpunb.errors import TpunbError

if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

    import torch
    from torch.utils.data import DataLoader

# Parameters of DataLoader that shard() sets itself rather than copying.
_REPLACED = {"self", "dataset", "sampler", "batch_sampler", "shuffle"}


class ShardedLoader:
    """This rank's shard of a DataLoader, on its XLA device: iterate it once an epoch.

    Each iteration is a new epoch: the sampler's epoch is set first, so a shuffled
    loader gets a new order every epoch, the same on every rank; sharded again in the same
    launch, the same loader goes on from its last epoch. ``loader`` is the rebuilt
    DataLoader (host side) and ``sampler`` its DistributedSampler.
    """

    def __init__(
        self, loader: DataLoader, device: torch.device, next_epoch: list[int] | None = None
    ) -> None:
        from torch_xla.distributed.parallel_loader import MpDeviceLoader

        self.loader = loader
        self.sampler = loader.sampler
        self._next_epoch = [0] if next_epoch is None else next_epoch
        self._device_loader = MpDeviceLoader(loader, device)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration runs."""
        return self._next_epoch[0]

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self._next_epoch[0] += 1
        return iter(self._device_loader)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.loader)


def shard(loader: DataLoader) -> ShardedLoader:
    """Inside a launched function: ``loader`` split across the cores and sent to this rank's
    device, shuffled (or not) like the original, ``set_epoch`` called each epoch (also when
    ``shard(loader)`` is called again for each epoch).

    Args:
        loader: the notebook's DataLoader, with its batch size per core.

    Returns:
        A ``ShardedLoader``: iterate it once an epoch; ``len`` is this rank's batches."""
    rebuild = distributed_version(loader)
    if not machine.in_rank():
        raise TpunbError(
            "shard(loader) runs inside the function given to tpunb.launch: it needs the "
            "rank's ordinal and the number of cores, which exist only there."
        )
    import torch_xla
    import torch_xla.runtime as xr

    from tpunb.launcher import recorder

    rank = xr.global_ordinal()
    # shard(loader) called anew each epoch (``for batch in tpunb.shard(loader)`` inside an
    # epoch loop) continues the loader's epochs instead of replaying epoch 0, the pitfall
    # of a forgotten set_epoch: the rank's recorder keeps them for the launch.
    in_launch = recorder.current()
    next_epoch = in_launch.next_epoch(loader) if in_launch else None
    return ShardedLoader(rebuild(xr.world_size(), rank), torch_xla.device(), next_epoch)


def distributed_version(loader):
    """Checks that ``loader`` can be split safely; returns ``rebuild(world_size, rank)``,
    which makes the per-rank DataLoader. Raises TpunbError saying what to do otherwise."""
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
    )

    name = type(loader).__name__
    if not isinstance(loader, DataLoader):
        raise TpunbError(f"shard() takes a torch DataLoader, got {name} {loader!r}.")
    if type(loader) is not DataLoader:
        raise TpunbError(
            f"shard() rebuilds plain DataLoaders only, and {name} is a subclass whose "
            "constructor it cannot call safely. Build it inside the launched function with "
            "sampler=DistributedSampler(dataset, num_replicas=xr.world_size(), "
            "rank=xr.global_ordinal(), shuffle=...), then wrap it in MpDeviceLoader."
        )
    if isinstance(loader.dataset, IterableDataset):
        raise TpunbError(
            f"shard() cannot split {type(loader.dataset).__name__}, an IterableDataset: it has "
            "no indices to divide between the cores. Make the dataset yield only the items "
            "of this rank (torch_xla.runtime.global_ordinal() of world_size()), or use a "
            "map-style Dataset."
        )
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise TpunbError(
            "shard() cannot split a DataLoader built with its own batch_sampler: the batches "
            "would have to be divided, not the samples. Build it with batch_size=... and a "
            "sampler (or shuffle=True), or shard the batch sampler yourself by rank."
        )
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return lambda world_size, rank: _checked(loader, world_size, rank)
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise TpunbError(
                "shard() cannot split a RandomSampler that draws with replacement or a set "
                "number of samples: DistributedSampler draws each sample once an epoch."
            )
        shuffle, seed = True, _seed(sampler.generator or loader.generator)
    elif type(sampler) is SequentialSampler:
        shuffle, seed = False, 0
    else:
        raise TpunbError(
            f"shard() knows how to split a DataLoader that reads in order or shuffled, not one "
            f"with a {type(sampler).__name__}. Give each rank its own sampler inside the "
            "launched function, using torch_xla.runtime.global_ordinal() and world_size()."
        )

    def rebuild(world_size, rank):
        distributed = DistributedSampler(
            loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
        )
        return DataLoader(loader.dataset, sampler=distributed, **_settings(loader))

    return rebuild


def _checked(loader, world_size, rank):
    sampler = loader.sampler
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        raise TpunbError(
            f"This DataLoader's DistributedSampler was built for rank {sampler.rank} of "
            f"{sampler.num_replicas}, but runs on rank {rank} of {world_size}: every core "
            "would read the wrong shard. Build the loader with a plain sampler (or "
            "shuffle=True) and let shard() add the DistributedSampler."
        )
    return loader


def _seed(generator):
    # Every rank must shuffle alike: a seed they share (forked from the same parent).
    import torch

    return generator.initial_seed() if generator is not None else torch.initial_seed()


def _settings(loader):
    """The constructor arguments of ``loader`` to keep: batch size, collate function,
    workers and their initialisation, drop_last, pinning, generator..."""
    from torch.utils.data import DataLoader

    settings = {
        name: getattr(loader, name)
        for name in inspect.signature(DataLoader.__init__).parameters
        if name not in _REPLACED and hasattr(loader, name)
    }
    if loader.num_workers == 0:  # DataLoader refuses these without worker processes
        settings.pop("prefetch_factor", None)
        settings.pop("persistent_workers", None)
    return settings
