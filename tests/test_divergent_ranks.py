"""Code that differs between ranks works on 8 simulated cores as on a TPU, or stops at once
with its cause named (never XLA's 10 s rendezvous abort)."""

import time

import pytest
import torch

import tpunb
from tpunb.simulation.collectives import CollectiveMismatch

CORES = 8


def _rank_dependent_work_around_a_collective(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    # Python numbers that differ between ranks, before and after the collective, and its
    # result read at once, before any torch_xla.sync().
    row = torch.arange(CORES, dtype=torch.float32, device=device) * (rank + 1) + 0.5 * rank
    received = xm.all_to_all(row, 0, 0, CORES)
    after = received * rank - rank
    return after.tolist()


def test_rank_dependent_numbers_and_reads_before_sync_work_as_on_a_tpu(cores8_each_layout):
    start = time.monotonic()
    results = tpunb.launch(_rank_dependent_work_around_a_collective)
    assert time.monotonic() - start < 10
    for rank, got in enumerate(results):
        # Rank r receives element r of each rank i's row: r (i + 1) + 0.5 i.
        received = [rank * (i + 1) + 0.5 * i for i in range(CORES)]
        assert got == [v * rank - rank for v in received]


def _last_batch_smaller_on_rank_3(rank, other_collective):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    for step in range(3):
        rows = 3 if rank == 3 and step == 2 else 4
        value = torch.ones(rows, 2, device=device)
        if other_collective and rank == 3 and step == 2:
            xm.all_gather(torch.ones(4, 2, device=device))
        else:
            xm.all_reduce(xm.REDUCE_SUM, value)
        torch_xla.sync()


@pytest.mark.parametrize("other_collective", [False, True], ids=["shape", "collective"])
def test_ranks_making_different_collective_calls_stop_at_once_with_the_cause(
    cores8_each_layout, no_children_left, other_collective
):
    start = time.monotonic()
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_last_batch_smaller_on_rank_3, other_collective)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert "raised CollectiveMismatch" in message
    assert "as their collective number 3" in message
    assert "rank 0, step 3: all_reduce('sum', float32[4, 2]) called from" in message
    if other_collective:  # xm.all_gather all-reduces a tensor with a slot for each rank
        assert (
            "rank 3, step 3: all_reduce('sum', float32[32, 2], groups=None) (in all_gather)"
            in message
        )
    else:
        assert "rank 3, step 3: all_reduce('sum', float32[3, 2]) called from" in message
    assert "test_divergent_ranks.py" in message and "in _last_batch_smaller_on_rank_3" in message
    assert issubclass(CollectiveMismatch, tpunb.TpunbError)


def _seeded_model(rank, seed):
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    weights = [p.detach().clone() for p in model.parameters()]
    model.to(torch_xla.device())
    xm.rendezvous("built")
    return weights


def _reference_model(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    return [p.detach().clone() for p in model.parameters()]


def test_manual_seed_in_every_rank_gives_every_core_the_same_weights(cores8):
    results = tpunb.launch(_seeded_model, 3)
    reference = _reference_model(3)
    for weights in results:
        assert all(torch.equal(w, r) for w, r in zip(weights, reference, strict=True))
