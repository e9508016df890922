"""A TPU script written for torch_xla only, in the style of torch_xla's own TPU tests
(test/pjrt/test_collective_ops_tpu.py, test/test_mp_all_reduce-style DDP checks):
``torch.distributed`` collectives with the ``xla`` backend followed by the metrics check
torch_xla's tests make, and ``DistributedDataParallel(gradient_as_bucket_view=True)``
trained against the same model trained on the global batch on the CPU."""

import copy

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.xla_backend  # noqa: F401 (registers the "xla" backend)
import torch_xla.runtime as xr
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, PER_CORE = 3, 4


def counted(cores, rank, device):
    """What torch_xla's test_collective_ops_tpu.py asserts after each eager collective."""
    checks = []
    met.clear_all()
    dist.all_reduce(torch.tensor([float(rank)], device=device))
    torch_xla.sync()
    names = met.counter_names()
    checks.append("xla::AllReduceInPlace" in names or "xla::AllReduce" in names)
    met.clear_all()
    dist.all_gather_into_tensor(torch.empty(cores, device=device), torch.ones(1, device=device))
    torch_xla.sync()
    names = met.counter_names()
    checks.append("xla::AllGather" in names or "xla::AllGatherOut" in names)
    met.clear_all()
    out = torch.zeros(2, device=device)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * cores, device=device))
    torch_xla.sync()
    names = met.counter_names()
    checks.append("xla::ReduceScatter" in names or "xla::ReduceScatterOut" in names)
    met.clear_all()
    out = torch.zeros(cores, device=device)
    dist.all_to_all_single(out, torch.full((cores,), float(rank), device=device))
    torch_xla.sync()
    checks.append("xla::AllToAll" in met.counter_names())
    return all(checks)


def bucket_views_train_as_the_cpu(cores, rank, device):
    torch.manual_seed(0)
    cpu_model = torch.nn.Linear(4, 2)
    features = torch.randn(STEPS, cores * PER_CORE, 4)
    targets = torch.randn(STEPS, cores * PER_CORE, 2)
    model = DDP(copy.deepcopy(cpu_model).to(device), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu_optimizer = torch.optim.SGD(cpu_model.parameters(), lr=0.1)
    mine = slice(rank * PER_CORE, (rank + 1) * PER_CORE)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = features[step][mine].to(device), targets[step][mine].to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        torch_xla.sync()
        cpu_optimizer.zero_grad()
        torch.nn.functional.mse_loss(cpu_model(features[step]), targets[step]).backward()
        cpu_optimizer.step()
    pairs = zip(model.module.parameters(), cpu_model.parameters(), strict=True)
    return all(torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5) for p, q in pairs)


def train(index):
    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    cores, rank = xr.world_size(), xr.global_ordinal()
    print(
        f"rank {rank}: counters {counted(cores, rank, device)}, "
        f"bucket views train as the CPU {bucket_views_train_as_the_cpu(cores, rank, device)}",
        flush=True,
    )


if __name__ == "__main__":
    torch_xla.launch(train)
