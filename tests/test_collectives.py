"""Every public collective of torch_xla on 8 simulated cores gives what the math says.

Rank r holds values built from r, so each result has a closed form computed here on the
CPU. Training through collectives (SyncBatchNorm, DistributedDataParallel) is checked
against single-device training on the global batch.
"""

import copy

import pytest
import torch
from conftest import in_forked_process

import tpunb

CORES = 8
HALVES = [[0, 1, 2, 3], [4, 5, 6, 7]]


def _half(rank):
    return HALVES[rank // 4]


def _xm_collectives(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()

    def on_device(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    r = float(rank)
    results = {}
    results["sum"] = xm.all_reduce(xm.REDUCE_SUM, on_device([r + 1]))
    results["max_in_halves"] = xm.all_reduce(xm.REDUCE_MAX, on_device([r]), groups=HALVES)
    results["min"] = xm.all_reduce(xm.REDUCE_MIN, on_device([r, -r]))
    results["list_scaled"] = xm.all_reduce(
        xm.REDUCE_SUM, [on_device([r]), on_device([[1.0, r]])], scale=0.5, pin_layout=False
    )
    results["gather"] = xm.all_gather(on_device([r, 10 * r]))
    results["gather_dim1"] = xm.all_gather(on_device([[r], [-r]]), dim=1)
    results["gather_halves"] = xm.all_gather(on_device([r]), groups=HALVES)
    results["gather_unpinned"] = xm.all_gather(on_device([r]), pin_layout=False)
    output = torch.zeros(CORES, device=device)
    xm.all_gather(on_device([r]), output=output, pin_layout=False)
    results["gather_output"] = output
    results["gather_list"] = xm.all_gather([on_device([r]), on_device([[r, r]])], pin_layout=False)
    # Rank r gives [0, 1, ..., 15] + 100 r; the sum is [8 i + 2800]; rank r keeps slot r.
    spread = torch.arange(16, dtype=torch.float32, device=device) + 100 * r
    results["scatter"] = xm.reduce_scatter(xm.REDUCE_SUM, spread, 1.0, 0, CORES)
    results["scatter_halves"] = xm.reduce_scatter(xm.REDUCE_SUM, spread, 0.25, 0, 4, groups=HALVES)
    results["scatter_list"] = xm.reduce_scatter(
        xm.REDUCE_SUM, [spread.clone(), spread[:8].clone()], 1.0, 0, CORES, pin_layout=False
    )
    # Rank r's row holds 10 r + j in column j; all_to_all sends column j to rank j.
    row = torch.arange(CORES, dtype=torch.float32, device=device) + 10 * r
    results["to_all"] = xm.all_to_all(row, 0, 0, CORES)
    ring = [[i, (i + 1) % CORES] for i in range(CORES)]
    results["permute"] = xm.collective_permute(on_device([r]), ring)
    broadcast = on_device([r, r])
    xm.collective_broadcast([broadcast], root_ordinal=5)
    results["broadcast"] = broadcast
    # torch's functional collectives, what dynamo traces collectives into (their XLA kernels
    # are torch_xla's): rank r gives [r + 1] and [r, 10 r].
    functional = torch.ops._c10d_functional
    results["functional_max"] = functional.all_reduce(on_device([r + 1]), "max", "")
    results["functional_gather"] = functional.all_gather_into_tensor(
        on_device([r, 10 * r]), CORES, ""
    )
    results["functional_scatter"] = functional.reduce_scatter_tensor(spread, "sum", CORES, "")
    results["functional_to_all"] = functional.all_to_all_single(row, [1] * CORES, [1] * CORES, "")
    torch_xla.sync()
    values = {
        key: [t.tolist() for t in value] if isinstance(value, list) else value.tolist()
        for key, value in results.items()
    }
    values["payloads"] = xm.rendezvous("exchange", f"from {rank}".encode())
    values["mean"] = xm.mesh_reduce("mean", r, lambda all_values: sum(all_values) / CORES)
    return values


def test_every_xm_collective_gives_what_the_math_says(cores8):
    results = tpunb.launch(_xm_collectives)
    ranks = range(CORES)
    for rank, got in enumerate(results):
        assert got["sum"] == [36.0]
        assert got["max_in_halves"] == [max(_half(rank))]
        assert got["min"] == [0.0, -7.0]
        assert got["list_scaled"] == [[14.0], [[4.0, 14.0]]]
        assert got["gather"] == [v for i in ranks for v in (i, 10 * i)]
        assert got["gather_dim1"] == [list(ranks), [-i for i in ranks]]
        assert got["gather_halves"] == _half(rank)
        assert got["gather_unpinned"] == list(ranks)
        assert got["gather_output"] == list(ranks)
        assert got["gather_list"] == [list(ranks), [[i, i] for i in ranks]]
        total = [8 * i + 2800.0 for i in range(16)]
        assert got["scatter"] == total[2 * rank : 2 * rank + 2]
        half_total = [4 * i + 100.0 * sum(_half(rank)) for i in range(16)]
        slot = _half(rank).index(rank)
        assert got["scatter_halves"] == [v / 4 for v in half_total[4 * slot : 4 * slot + 4]]
        assert got["scatter_list"] == [total[2 * rank : 2 * rank + 2], [total[rank]]]
        assert got["to_all"] == [10.0 * i + rank for i in ranks]
        assert got["permute"] == [float((rank - 1) % CORES)]
        assert got["broadcast"] == [5.0, 5.0]
        assert got["functional_max"] == [8.0]
        assert got["functional_gather"] == [v for i in ranks for v in (i, 10 * i)]
        assert got["functional_scatter"] == total[2 * rank : 2 * rank + 2]
        assert got["functional_to_all"] == [10.0 * i + rank for i in ranks]
        assert got["payloads"] == [f"from {i}".encode() for i in ranks]
        assert got["mean"] == 3.5


def _send_and_recv(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    value = torch.tensor([rank, rank * rank], dtype=torch.float32, device=device)
    if rank % 2 == 0:
        xm.send(value * 2, channel_id=rank)
        return None
    return xm.recv(torch.zeros(2, device=device), channel_id=rank - 1).tolist()


def test_send_and_recv_pair_ranks_by_channel(cores8):
    results = tpunb.launch(_send_and_recv)
    for rank, got in enumerate(results):
        sender = rank - 1
        assert got == (None if rank % 2 == 0 else [2.0 * sender, 2.0 * sender * sender])


def _differentiable(rank):
    import torch_xla
    import torch_xla.core.functions as xf
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    value = torch.tensor([rank + 1.0, 2.0], device=device, requires_grad=True)
    total = xf.all_reduce(xm.REDUCE_SUM, value * value)
    gathered = xf.all_gather(value * 3, dim=0)
    weights = torch.arange(2.0 * CORES, device=device)
    (total.sum() * (rank + 1) + (gathered * weights).sum()).backward()
    # distributed_mm: rank r holds columns [2r, 2r + 2) of W (3 x 16) and its own x (16 x 4),
    # and gets W @ x.
    full_w = torch.arange(48.0).reshape(3, 16) / 10
    x = (torch.arange(64.0).reshape(16, 4) - 30) / 10 + rank
    product = xf.distributed_mm(full_w[:, 2 * rank : 2 * rank + 2].to(device), x.to(device))
    torch_xla.sync()
    return {
        "total": total.tolist(),
        "gathered": gathered.tolist(),
        "grad": value.grad.tolist(),
        "product": product.tolist(),
        "expected_product": (full_w @ x).tolist(),
    }


def test_differentiable_collectives_and_their_gradients(cores8):
    results = tpunb.launch(_differentiable)
    values = [[r + 1.0, 2.0] for r in range(CORES)]
    for rank, got in enumerate(results):
        assert got["total"] == [sum(v[0] ** 2 for v in values), 4.0 * CORES]
        assert got["gathered"] == [3 * x for v in values for x in v]
        # d/dv of (rank+1) * sum(v^2): 2 v (rank+1); all_reduce's backward is the identity.
        # d/dv of gathered . weights: 3 * weights[2 rank : 2 rank + 2] (all_gather's backward
        # is this rank's slice).
        v = values[rank]
        expected = [2 * v[i] * (rank + 1) + 3 * (2 * rank + i) for i in range(2)]
        assert got["grad"] == pytest.approx(expected)
        assert torch.allclose(
            torch.tensor(got["product"]), torch.tensor(got["expected_product"]), rtol=1e-5
        )


def _torch_distributed(rank):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401 (registers the "xla" backend)

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    r = float(rank)
    total = torch.tensor([r, 1.0], device=device)
    dist.all_reduce(total)
    biggest = torch.tensor([r], device=device)
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    pieces = [torch.zeros(2, device=device) for _ in range(CORES)]
    dist.all_gather(pieces, torch.tensor([r, -r], device=device))
    into = torch.zeros(2 * CORES, device=device)
    dist.all_gather_into_tensor(into, torch.tensor([r, -r], device=device))
    scattered = torch.zeros(2, device=device)
    dist.reduce_scatter_tensor(scattered, torch.arange(16.0, device=device) + r)
    from_list = torch.zeros(2, device=device)
    dist.reduce_scatter(from_list, [torch.full((2,), r + i, device=device) for i in range(CORES)])
    shared = torch.tensor([r, r], device=device)
    dist.broadcast(shared, src=3)
    dist.barrier()
    torch_xla.sync()
    return {
        "world": (dist.get_rank(), dist.get_world_size()),
        "total": total.tolist(),
        "biggest": biggest.tolist(),
        "pieces": [p.tolist() for p in pieces],
        "into": into.tolist(),
        "scattered": scattered.tolist(),
        "from_list": from_list.tolist(),
        "shared": shared.tolist(),
    }


def test_torch_distributed_with_the_xla_backend(cores8):
    results = tpunb.launch(_torch_distributed)
    ranks = range(CORES)
    for rank, got in enumerate(results):
        assert got["world"] == (rank, CORES)
        assert got["total"] == [28.0, 8.0]
        assert got["biggest"] == [7.0]
        assert got["pieces"] == [[i, -i] for i in ranks]
        assert got["into"] == [v for i in ranks for v in (i, -i)]
        assert got["scattered"] == [8.0 * i + 28 for i in (2 * rank, 2 * rank + 1)]
        assert got["from_list"] == [8.0 * rank + 28] * 2
        assert got["shared"] == [3.0, 3.0]


# Training through collectives equals training on one device with the global batch.
BATCH, STEPS = 16, 8
SAMPLES = STEPS * CORES * BATCH
OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def _problem(norm):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, 6, generator=generator) * 3 + 1
    targets = inputs[:, :2].sum(dim=1, keepdim=True)
    torch.manual_seed(0)
    # No bias before the norm: its gradient is 0 up to rounding, which Adam's update scales up.
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), norm(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )
    return inputs, targets, model


def _rank_batches(inputs, targets, rank, step):
    start = (step * CORES + rank) * BATCH
    return inputs[start : start + BATCH], targets[start : start + BATCH]


def _train_with_sync_batch_norm(rank, inputs, targets, model, optimizer):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model = copy.deepcopy(model).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(STEPS):
        x, y = (t.to(device) for t in _rank_batches(inputs, targets, rank, step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        xm.optimizer_step(opt)
        torch_xla.sync()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _train_with_ddp(rank, inputs, targets, model, optimizer):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    model = DistributedDataParallel(copy.deepcopy(model).to(device))
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(STEPS):
        x, y = (t.to(device) for t in _rank_batches(inputs, targets, rank, step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        torch_xla.sync()
    return {k: v.cpu() for k, v in model.module.state_dict().items()}


def _train_on_one_device(inputs, targets, model, optimizer):
    model = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(STEPS):
        start = step * CORES * BATCH
        x, y = inputs[start : start + CORES * BATCH], targets[start : start + CORES * BATCH]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _assert_same_parameters(states, reference):
    for state in states:
        for name, value in reference.items():
            if name.endswith("running_var") or name.endswith("num_batches_tracked"):
                continue  # SyncBatchNorm keeps the biased variance; BatchNorm the unbiased
            assert torch.allclose(state[name], value, atol=1e-5), name


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sync_batch_norm_training_equals_batch_norm_on_the_global_batch(cores8, optimizer):
    from torch_xla.core.functions import SyncBatchNorm

    inputs, targets, model = _problem(SyncBatchNorm)
    states = tpunb.launch(_train_with_sync_batch_norm, inputs, targets, model, optimizer)
    reference_model = copy.deepcopy(model)
    reference_model[1] = torch.nn.BatchNorm1d(8)
    reference_model[1].load_state_dict(model[1].state_dict(), strict=False)
    reference = in_forked_process(_train_on_one_device, inputs, targets, reference_model, optimizer)
    _assert_same_parameters(states, reference)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_distributed_data_parallel_training_equals_the_global_batch(cores8, optimizer):
    inputs, targets, model = _problem(lambda width: torch.nn.Identity())
    states = tpunb.launch(_train_with_ddp, inputs, targets, model, optimizer)
    reference = in_forked_process(_train_on_one_device, inputs, targets, model, optimizer)
    _assert_same_parameters(states, reference)


def _dropped_after_a_collective(rank):
    import weakref

    import torch_xla
    import torch_xla.core.xla_model as xm

    x = torch.ones(4, device=torch_xla.device()) * rank
    total = xm.all_reduce(xm.REDUCE_SUM, x)
    torch_xla.sync()
    kept = weakref.ref(x)
    del x  # the program's only reference
    return kept() is None, float(total[0])


def test_a_tensor_the_program_drops_is_freed_after_a_collective_it_went_through(
    cores8,
):
    # A rank's collective call once kept its caller's frames, and with them every tensor
    # of the call (those of a step that failed on the device too) until its next call.
    assert tpunb.launch(_dropped_after_a_collective, live=False) == [(True, 28.0)] * 8
