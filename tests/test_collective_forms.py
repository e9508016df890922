"""Every form of torch_xla's collectives gives, on each simulated core, the bits XLA defines:
one tensor and lists, ``output=`` (which takes the result's shape), pin_layout true and
false, groups, scale, the bucketized forms, over the shapes and dtypes of pytorch/xla's own
test_mp_* tests. The reference is computed here from every rank's inputs, drawn again."""

import pytest
import torch

import tpunb

CORES = 8
HALVES = [[0, 1, 2, 3], [4, 5, 6, 7]]
SHARD = 2  # test_mp_reduce_scatter.py's shard_size


def _inputs(rank, dtype):
    """Rank ``rank``'s tensor and list of three, drawn from its own seed."""
    generator = torch.Generator().manual_seed(rank)

    def drawn():
        return torch.randint(-8, 9, (32, SHARD * CORES, 32), generator=generator).to(dtype)

    return drawn(), [drawn() for _ in range(3)], generator


def _forms(rank, dtype):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    one, several, generator = _inputs(rank, dtype)
    one, several = one.to(device), [t.to(device) for t in several]

    def drawn(*shape):
        values = torch.randint(-8, 9, shape, generator=generator).to(dtype)
        return values.to(device)

    results = {}
    for pinned in (True, False):
        name = "pinned" if pinned else "unpinned"
        results[f"reduce_{name}"] = xm.all_reduce(xm.REDUCE_SUM, one, pin_layout=pinned)
        results[f"reduce_list_{name}"] = xm.all_reduce(
            xm.REDUCE_MAX, [t.clone() for t in several], pin_layout=pinned
        )
        results[f"gather_{name}"] = xm.all_gather(one, dim=1, pin_layout=pinned)
    results["reduce_halves_scaled"] = xm.all_reduce(xm.REDUCE_SUM, one, scale=0.5, groups=HALVES)
    results["gather_list"] = xm.all_gather(several, dim=0, pin_layout=False)
    gathered = [torch.zeros(32 * CORES, SHARD * CORES, 32, dtype=dtype, device=device)]
    results["gather_list_output"] = xm.all_gather(
        several[:1], dim=0, output=gathered, pin_layout=False
    )
    results["gather_bucketized"] = xm.all_gather_bucketized(several, dim=0, pin_layout=False)
    results["scatter"] = xm.reduce_scatter(xm.REDUCE_SUM, one, 1.0, 1, CORES)
    results["scatter_halves"] = xm.reduce_scatter(xm.REDUCE_SUM, one, 0.25, 1, 4, groups=HALVES)
    results["scatter_list"] = xm.reduce_scatter(
        xm.REDUCE_SUM, several, 1.0, 1, CORES, pin_layout=False
    )
    # As test_mp_reduce_scatter.py does: full-size outputs, which take the shards' shape.
    outputs = [drawn(32, SHARD * CORES, 32) for _ in range(3)]
    returned = xm.reduce_scatter(
        xm.REDUCE_SUM, several, 1.0, 1, CORES, output=outputs, pin_layout=False
    )
    assert returned == outputs
    results["scatter_list_output"] = outputs
    output = torch.zeros(32, SHARD, 32, dtype=dtype, device=device)
    xm.reduce_scatter(xm.REDUCE_SUM, one, 1.0, 1, CORES, output=output)
    results["scatter_output"] = output
    results["scatter_bucketized"] = xm.reduce_scatter_bucketized(
        xm.REDUCE_SUM, several, 1.0, 1, CORES, pin_layout=False
    )
    results["to_all"] = xm.all_to_all(one, 1, 0, CORES)
    torch_xla.sync()
    return {
        key: [t.cpu() for t in value] if isinstance(value, list) else value.cpu()
        for key, value in results.items()
    }


def _expected(rank, dtype):
    """What XLA defines each form to give rank ``rank``: reductions in rank order, a scale
    applied in the values' own dtype (an int32 scale of 0.5 is 0, as XLA's CPU backend gave
    while the simulation could also run its collectives), shards and groups by rank."""
    ones, severals = zip(*[_inputs(r, dtype)[:2] for r in range(CORES)], strict=True)
    half = HALVES[rank // 4]

    def scaled(value, scale):
        return value * torch.tensor(scale, dtype=dtype)

    def shard(whole, count, index):
        size = whole.shape[1] // count
        return whole.narrow(1, index * size, size)

    total = torch.stack(ones).sum(0, dtype=dtype)
    totals = [torch.stack([s[i] for s in severals]).sum(0, dtype=dtype) for i in range(3)]
    gathered = [torch.cat([s[i] for s in severals], 0) for i in range(3)]
    halves = scaled(torch.stack([ones[r] for r in half]).sum(0, dtype=dtype), 0.25)
    scattered = [shard(t, CORES, rank) for t in totals]
    maxima = [torch.stack([s[i] for s in severals]).amax(0) for i in range(3)]
    return {
        **{f"reduce_{name}": total for name in ("pinned", "unpinned")},
        **{f"reduce_list_{name}": maxima for name in ("pinned", "unpinned")},
        **{f"gather_{name}": torch.cat(ones, 1) for name in ("pinned", "unpinned")},
        "reduce_halves_scaled": scaled(
            torch.stack([ones[r] for r in half]).sum(0, dtype=dtype), 0.5
        ),
        "gather_list": gathered,
        "gather_list_output": gathered[:1],
        "gather_bucketized": gathered,
        "scatter": shard(total, CORES, rank),
        "scatter_halves": shard(halves, 4, half.index(rank)),
        "scatter_list": scattered,
        "scatter_list_output": scattered,
        "scatter_output": shard(total, CORES, rank),
        "scatter_bucketized": scattered,
        "to_all": torch.cat([shard(one, CORES, rank) for one in ones], 0),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_each_collective_form_gives_what_xla_defines_on_every_core(cores8, dtype):
    results = tpunb.launch(_forms, dtype, live=False)
    for rank in range(CORES):
        expected = _expected(rank, dtype)
        assert results[rank].keys() == expected.keys()
        for key, want in expected.items():
            got = results[rank][key]
            got, want = (got, want) if isinstance(got, list) else ([got], [want])
            assert len(got) == len(want), key
            for a, b in zip(got, want, strict=True):
                assert a.dtype == dtype and a.shape == b.shape, (rank, key)
                assert torch.equal(a, b), (rank, key)
    # The shard each rank keeps is its own: the shapes of test_mp_reduce_scatter.py.
    assert results[3]["scatter_list_output"][0].shape == (32, SHARD, 32)
