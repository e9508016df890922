"""Code that differs between ranks works on 8 simulated cores as on a TPU, or stops at once
with its cause named (never XLA's 10 s rendezvous abort)."""

import os
import warnings

import pytest
import torch

import tpunb
from tpunb.errors import CollectiveMismatch

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


def test_rank_dependent_numbers_and_reads_before_sync_work_as_on_a_tpu(cores8):
    results = tpunb.launch(_rank_dependent_work_around_a_collective)
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
            xm.all_gather(torch.ones(4, 2, device=device))  # line: other collective
        else:
            xm.all_reduce(xm.REDUCE_SUM, value)  # line: the collective
        torch_xla.sync()


def _line(marker):
    """The line of this file that ends with ``# line: marker``."""
    with open(__file__) as source:
        for number, text in enumerate(source, 1):
            if text.rstrip().endswith(f"# line: {marker}"):
                return f"{__file__}, line {number}"
    raise AssertionError(marker)


@pytest.mark.parametrize("other_collective", [False, True], ids=["shape", "collective"])
def test_ranks_making_different_collective_calls_stop_at_once_with_the_cause(
    cores8, no_children_left, other_collective
):
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_last_batch_smaller_on_rank_3, other_collective)
    message = str(caught.value)
    assert "at their collective call number 3 they made different calls" in message
    assert "ranks 0-2, 4-7: all_reduce('sum', float32[4, 2]) at " in message
    assert f"{_line('the collective')}, in step 3" in message
    if other_collective:
        assert "rank 3: all_gather(float32[4, 2]) at " in message
        assert f"{_line('other collective')}, in step 3" in message
    else:
        assert "rank 3: all_reduce('sum', float32[3, 2]) at " in message
    assert caught.value.ranks == (3,)
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


# Ranks that take different paths to their collectives, as on a TPU: the simulated ranks
# wait as a TPU's would, and the one judge of the ranks' calls (tpunb/watch/collective_calls.py)
# names each, with its line: the launch's, or with no launch around them the simulation's.


def _collective_under_if(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    total = torch.ones(4, device=torch_xla.device())
    if rank == 0:
        total = xm.all_reduce(xm.REDUCE_SUM, total)  # line: under the if
    total = xm.all_reduce(xm.REDUCE_SUM, total)  # line: on every rank
    torch_xla.sync()


def _rendezvous_on_one_rank(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    weights = torch.ones(4, device=torch_xla.device())
    for step in range(3):
        weights = xm.all_reduce(xm.REDUCE_SUM, weights) / CORES  # line: the step all-reduce
        torch_xla.sync()
        if rank == 0 and step == 1:
            xm.rendezvous("checkpoint written")  # line: rendezvous


def _uneven_batches(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    # 130 samples split by hand, without DistributedSampler's padding: ranks 0 and 1 get
    # 17, the others 16, so 5 batches of 4 against 4.
    samples = torch.arange(130.0)[rank::CORES]
    for batch in torch.utils.data.DataLoader(samples, batch_size=4):
        loss = batch.to(torch_xla.device()).mean()
        xm.all_reduce(xm.REDUCE_SUM, [loss])  # line: a batch all-reduce
        torch_xla.sync()


def _evaluation_on_rank_0(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    weights = torch.ones(4, device=torch_xla.device())
    for _step in range(2):
        weights = xm.all_reduce(xm.REDUCE_SUM, weights) / CORES  # line: training all-reduce
        torch_xla.sync()
    if rank == 0:  # an extra graph on rank 0, and an accuracy reduced over the ranks
        accuracy = (weights > 0.5).float().mean()
        torch_xla.sync()
        xm.mesh_reduce("accuracy", accuracy.item(), sum)  # line: evaluation


DIVERGENCES = {
    "collective under an if": (
        _collective_under_if,
        2,
        [
            f"rank 0: all_reduce('sum', float32[4]) at {_line('on every rank')}, in step 1",
            "ranks 1-7: made none: returned after 1 collective call",
            (
                "Their paths parted earlier, at call number 1, made from different lines:\n"
                f"  rank 0: all_reduce('sum', float32[4]) at {_line('under the if')}, in step 1\n"
                f"  ranks 1-7: all_reduce('sum', float32[4]) at {_line('on every rank')}, in step 1"
            ),
        ],
    ),
    "rendezvous on one rank": (
        _rendezvous_on_one_rank,
        3,
        [
            (
                f"rank 0: all_gather(int32[1]) at {_line('rendezvous')} (through torch_xla's "
                "rendezvous), in step 4"
            ),
            f"ranks 1-7: all_reduce('sum', float32[4]) at {_line('the step all-reduce')}",
        ],
    ),
    "uneven batches": (
        _uneven_batches,
        5,
        [
            (
                f"ranks 0, 1: all_reduce('sum', [float32[]]) at {_line('a batch all-reduce')}, "
                "in step 5"
            ),
            "ranks 2-7: made none: returned after 4 collective calls",
        ],
    ),
    "an extra graph on rank 0": (
        _evaluation_on_rank_0,
        3,
        [
            (
                f"rank 0: all_gather(int32[1]) at {_line('evaluation')} (through torch_xla's "
                "mesh_reduce)"
            ),
            "ranks 1-7: made none: returned after 2 collective calls",
        ],
    ),
}


def _assert_named(caught, position, lines):
    message = str(caught.value)
    assert f"at their collective call number {position} they made different calls" in message
    for line in lines:
        assert line in message
    assert "Every rank must make the same collective calls in the same order." in message


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_ranks_that_take_different_paths_are_named_with_their_lines_at_once(
    cores8, no_children_left, divergence
):
    function, position, lines = DIVERGENCES[divergence]
    with warnings.catch_warnings(), pytest.raises(tpunb.RankError) as caught:
        warnings.simplefilter("ignore", tpunb.TpunbWarning)  # the paths parting: below
        tpunb.launch(function, live=False)
    _assert_named(caught, position, lines)


@pytest.mark.parametrize(
    "divergence", ["collective under an if", "rendezvous on one rank", "uneven batches"]
)
def test_a_plain_xmp_spawn_whose_ranks_take_different_paths_raises_the_same_report(
    cores8, no_children_left, divergence
):
    # No launch around the ranks: the simulation's meeting judges their calls, with the
    # same judge, and the waiting ranks raise its verdict through xmp.spawn.
    import torch_xla.distributed.xla_multiprocessing as xmp

    function, position, lines = DIVERGENCES[divergence]
    with pytest.raises(CollectiveMismatch) as caught:
        xmp.spawn(function, start_method="fork")
    _assert_named(caught, position, lines)


def _same_call_in_two_branches(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    total = torch.ones(4, device=torch_xla.device())
    for _ in range(3):
        if rank == 0:
            total = xm.all_reduce(xm.REDUCE_SUM, total) / CORES  # line: rank 0 branch
        else:
            total = xm.all_reduce(xm.REDUCE_SUM, total) / CORES  # line: the other branch
        torch_xla.sync()
    return total.cpu().tolist()


def test_the_same_call_from_other_lines_is_warned_about_once(cores8):
    # The ranks' calls meet, but from other lines: the way a collective under an `if`
    # starts. The warning comes as the launch's watch sees it, at the latest at its end.
    with pytest.warns(tpunb.TpunbWarning) as warned:
        results = tpunb.launch(_same_call_in_two_branches, live=False)
    assert results[0] == results[7] == [1.0] * 4
    [warning] = [w for w in warned if "from different lines" in str(w.message)]
    assert str(warning.message).startswith(
        "The ranks made their collective call number 1 from different lines:\n"
        f"  rank 0: all_reduce('sum', float32[4]) at {_line('rank 0 branch')}, in step 1\n"
        f"  ranks 1-7: all_reduce('sum', float32[4]) at {_line('the other branch')}"
    )
    assert warning.filename == __file__  # shown at the launch's line


def _same_calls_and_point_to_point(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    value = torch.full((2,), float(rank), device=device)
    for _ in range(3):
        value = xm.all_reduce(xm.REDUCE_SUM, value) / CORES
        torch_xla.sync()
    xm.save({"value": value}, os.devnull)  # the master writes; no collective in 2.8, 2.9
    if rank in (0, 1):  # rank 0 sends, rank 1 receives: other calls by design
        if rank == 0:
            xm.send(value, 7)
        else:
            value = xm.recv(torch.zeros(2, device=device), 7)
    return value.cpu().tolist()


def test_ranks_that_stay_together_are_left_alone(cores8, no_children_left):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_same_calls_and_point_to_point, live=False)
    assert results[2] == pytest.approx([3.5, 3.5])
