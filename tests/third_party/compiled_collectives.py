"""A TPU script written for torch_xla only that compiles its collectives whole with
``torch.compile(backend="openxla", fullgraph=True)``: the mean of a value over the cores,
every core's rows gathered, and a sum through ``torch.distributed``'s XLA backend, each
with work before and after the collective. Each call gets other data, so a result compiled
into the graph would show."""

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_backend  # noqa: F401 (registers the "xla" backend)
import torch_xla.runtime as xr


def mean_over_cores(t):
    return xm.all_reduce(xm.REDUCE_SUM, t.sin()) / xr.world_size()


def gathered_norms(t):
    return xm.all_gather(t * t, dim=0).sum(dim=1).sqrt()


def summed_doubles(t):
    t = t * 2
    dist.all_reduce(t)
    return t + 1


def train(index):
    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    mean = torch.compile(mean_over_cores, backend="openxla", fullgraph=True)
    norms = torch.compile(gathered_norms, backend="openxla", fullgraph=True)
    doubles = torch.compile(summed_doubles, backend="openxla", fullgraph=True)
    cores, rank = xr.world_size(), xr.global_ordinal()
    right = 0
    for call in range(3):
        rows = torch.arange(6.0).view(2, 3) + 10 * rank + call
        got_mean = mean(rows.to(device)).cpu()
        got_norms = norms(rows.to(device)).cpu()
        got_doubles = doubles(rows.to(device)).cpu()
        every = [torch.arange(6.0).view(2, 3) + 10 * r + call for r in range(cores)]
        want_mean = sum(r.sin() for r in every) / cores
        want_norms = torch.cat(every).pow(2).sum(dim=1).sqrt()
        right += torch.allclose(got_mean, want_mean, atol=1e-5)
        right += torch.allclose(got_norms, want_norms)
        right += torch.equal(got_doubles, 2 * sum(every) + 1)
    print(f"rank {rank}: {right} of 9 compiled results right", flush=True)


if __name__ == "__main__":
    torch_xla.launch(train)
