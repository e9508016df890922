"""Every form of torch_xla's collectives gives the same bits on a process a core (computed on
the host) as on the threads (computed by XLA's CPU backend): one tensor and lists, ``output=``
(which takes the result's shape), pin_layout true and false, groups, scale, the bucketized
forms, over the shapes and dtypes of pytorch/xla's own test_mp_* tests."""

import pytest
import torch

import tpunb

CORES = 8
HALVES = [[0, 1, 2, 3], [4, 5, 6, 7]]
SHARD = 2  # test_mp_reduce_scatter.py's shard_size


def _forms(rank, dtype):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    generator = torch.Generator().manual_seed(rank)

    def drawn(*shape):
        values = torch.randint(-8, 9, shape, generator=generator).to(dtype)
        return values.to(device)

    results = {}
    one = drawn(32, SHARD * CORES, 32)
    several = [drawn(32, SHARD * CORES, 32) for _ in range(3)]
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_each_collective_form_gives_the_threads_xla_results_on_a_process_a_core(dtype):
    # XLA's CPU backend refuses bfloat16 collectives ("AllReduce for datatype 'bf16' is not
    # supported"), where a TPU runs them: the processes' bfloat16 results are checked
    # against XLA's float32 ones, exact for these small integers.
    by_xla_in = torch.float32 if dtype == torch.bfloat16 else dtype
    tpunb.simulate(cores=CORES, layout="threads")
    by_xla = tpunb.launch(_forms, by_xla_in, live=False)
    tpunb.simulate(cores=CORES, layout="processes")
    on_host = tpunb.launch(_forms, dtype, live=False)
    for rank in range(CORES):
        assert by_xla[rank].keys() == on_host[rank].keys()
        for key in by_xla[rank]:
            xla, host = by_xla[rank][key], on_host[rank][key]
            xla, host = (xla, host) if isinstance(xla, list) else ([xla], [host])
            assert len(xla) == len(host), key
            for a, b in zip(xla, host, strict=True):
                assert a.shape == b.shape and b.dtype == dtype, (rank, key)
                assert torch.equal(a.to(dtype), b), (rank, key)
    # The shard each rank keeps is its own: the shapes of test_mp_reduce_scatter.py.
    assert on_host[3]["scatter_list_output"][0].shape == (32, SHARD, 32)
