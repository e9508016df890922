"""shard(): the per-core loader inserted for a DataLoader built in the notebook."""

import collections

import pytest
import torch
from conftest import in_forked_process, run_python
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    WeightedRandomSampler,
)

import tpunb
from tpunb.sampling import distributed_version


def _indices_seen(rank, loader, epochs):
    sharded = tpunb.shard(loader)
    seen = [[int(i) for batch in sharded for i in batch[0].cpu()] for _ in range(epochs)]
    return seen, len(sharded), sharded.loader.batch_size, sharded.loader.drop_last


def _indices_seen_sharding_each_epoch(rank, loader, epochs):
    # The README's idiom written inside an epoch loop: a new sharded loader each epoch.
    seen = []
    for _ in range(epochs):
        seen.append([int(i) for batch in tpunb.shard(loader) for i in batch[0].cpu()])
    return seen


def test_sharding_again_each_epoch_goes_on_to_the_next_epoch(cores8):
    loader = DataLoader(TensorDataset(torch.arange(512)), batch_size=16, shuffle=True)
    once = tpunb.launch(_indices_seen, loader, 3)
    each_epoch = tpunb.launch(_indices_seen_sharding_each_epoch, loader, 3)
    assert each_epoch == [seen for seen, *_ in once]  # the same epochs, in the same order
    for epoch in range(3):
        assert sorted(i for seen in each_epoch for i in seen[epoch]) == list(range(512))
    orders = [[i for seen in each_epoch for i in seen[epoch]] for epoch in range(3)]
    assert len({tuple(order) for order in orders}) == 3  # a new order every epoch


@pytest.mark.parametrize("samples, padding", [(1000, 0), (1003, 5)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_an_epoch_disjoint_ranks(cores8, samples, padding, shuffle):
    loader = DataLoader(TensorDataset(torch.arange(samples)), batch_size=16, shuffle=shuffle)
    results = tpunb.launch(_indices_seen, loader, 2)
    for epoch in range(2):
        shards = [seen[epoch] for seen, *_ in results]
        counts = collections.Counter(i for shard in shards for i in shard)
        assert set(counts) == set(range(samples))  # every sample, every epoch
        # DistributedSampler pads to a multiple of 8 by repeating the first samples.
        assert sum(counts.values()) == samples + padding
        assert sorted(i for i, n in counts.items() if n == 2) == sorted(
            (
                torch.randperm(
                    samples, generator=torch.Generator().manual_seed(torch.initial_seed() + epoch)
                )
                if shuffle
                else torch.arange(samples)
            )[:padding].tolist()
        )
        assert {len(shard) for shard in shards} == {(samples + padding) // 8}
    first, second = ([i for seen, *_ in results for i in seen[e]] for e in (0, 1))
    assert (first != second) == shuffle  # a new order each epoch only when shuffled
    assert {(steps, batch, drop) for _, steps, batch, drop in results} == {(8, 16, False)}


def _shard_settings(rank, loader):
    sharded = tpunb.shard(loader).loader
    return (
        sharded.batch_size,
        sharded.collate_fn is loader.collate_fn,
        sharded.drop_last,
        sharded.pin_memory,
        sharded.worker_init_fn is loader.worker_init_fn,
        sharded.generator is loader.generator,
        type(sharded.sampler).__name__,
        sharded.sampler.shuffle,
        sharded.sampler.seed,
    )


def _collate(batch):
    return torch.utils.data.default_collate(batch)


def _worker_init(worker_id):
    pass


def test_the_rebuilt_loader_keeps_the_original_settings(cores8):
    generator = torch.Generator().manual_seed(1234)
    loader = DataLoader(
        TensorDataset(torch.arange(100)),
        batch_size=24,
        shuffle=True,
        collate_fn=_collate,
        drop_last=True,
        worker_init_fn=_worker_init,
        generator=generator,
    )
    settings = set(tpunb.launch(_shard_settings, loader))
    assert settings == {(24, True, True, False, True, True, "DistributedSampler", True, 1234)}


def _kept(rank, loader):
    return tpunb.shard(loader).loader is loader


def test_a_loader_with_its_own_distributed_sampler_is_left_alone():
    dataset = TensorDataset(torch.arange(10))
    ok = DataLoader(dataset, sampler=DistributedSampler(dataset, num_replicas=1, rank=0))
    assert distributed_version(ok)(1, 0) is ok
    with pytest.raises(tpunb.TpunbError, match="built for rank 0 of 1, but runs on rank 3 of 8"):
        distributed_version(ok)(8, 3)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


class _MyLoader(DataLoader):
    pass


_dataset = TensorDataset(torch.arange(10))


@pytest.mark.parametrize(
    "loader, message",
    [
        (_MyLoader(_dataset, batch_size=2), r"_MyLoader is a subclass"),
        (DataLoader(_Stream(), batch_size=2), r"_Stream, an IterableDataset"),
        (DataLoader(_dataset, batch_sampler=[[0, 1], [2, 3]]), r"its own batch_sampler"),
        (
            DataLoader(_dataset, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10)),
            r"not one with a WeightedRandomSampler",
        ),
        (
            DataLoader(
                _dataset,
                batch_size=2,
                sampler=torch.utils.data.RandomSampler(_dataset, replacement=True),
            ),
            r"with replacement",
        ),
        ([1, 2, 3], r"takes a torch DataLoader, got list"),
    ],
)
def test_loaders_that_cannot_be_split_safely_are_refused(loader, message):
    with pytest.raises(tpunb.TpunbError, match=message):
        tpunb.shard(loader)


def test_refusals_reach_the_notebook_from_the_rank_before_any_batch(cores8):
    loader = DataLoader(_Stream(), batch_size=2)
    # Every rank fails: the report names the lowest of those whose error came first.
    with pytest.raises(
        tpunb.RankError, match=r"^rank \d raised TpunbError: shard\(\) cannot split"
    ):
        tpunb.launch(lambda rank: [b for b in tpunb.shard(loader)])


def test_shard_in_the_notebook_itself_says_where_it_belongs():
    loader = DataLoader(_dataset, batch_size=2)
    with pytest.raises(tpunb.TpunbError, match="runs inside the function given to tpunb.launch"):
        tpunb.shard(loader)


def test_shard_in_a_notebook_that_used_the_device_is_no_rank_either():
    # The runtime runs in this process, but no xmp.spawn started it: world size 1, rank 0.
    result = run_python(
        """
        import torch, tpunb, torch_xla
        from torch.utils.data import DataLoader, TensorDataset
        tpunb.simulate(cores=8)
        torch_xla.device()
        try:
            tpunb.shard(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
        except tpunb.TpunbError as error:
            print("refused:", error)
        """
    )
    assert "refused: shard(loader) runs inside the function given" in result.stdout, result.stderr


def _train_through_shard(rank, model, loader, optimizer):
    import copy

    import torch_xla
    import torch_xla.core.xla_model as xm
    from test_data_parallel import EPOCHS, OPTIMIZERS

    model = copy.deepcopy(model).to(torch_xla.device())
    opt = OPTIMIZERS[optimizer](model.parameters())
    sharded = tpunb.shard(loader)
    for _ in range(EPOCHS):
        for inputs, targets in sharded:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            xm.optimizer_step(opt)
    return model.state_dict()


@pytest.mark.parametrize("shuffle", [False, True])
def test_data_parallel_training_through_shard_matches_the_global_batch(cores8, shuffle):
    import test_data_parallel as reference

    dataset, model = reference._problem()
    loader = DataLoader(
        dataset,
        batch_size=reference.BATCH,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(7),
    )
    states = tpunb.launch(_train_through_shard, model, loader, "Adam")
    expected = in_forked_process(reference._train_on_one_device, model, dataset, "Adam", shuffle)
    reference._assert_replicas_equal_reference(states, expected, model)
