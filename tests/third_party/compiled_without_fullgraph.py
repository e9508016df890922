"""A TPU script written for torch_xla only, in the style of torch_xla's own TPU tests
(test/pjrt/test_collective_ops_tpu.py, test/dynamo/test_traceable_collectives.py): functions
holding ``torch.distributed`` and functional collectives compiled with
``torch.compile(backend="openxla")``, without ``fullgraph=True``, with and without
``dynamic=True``. Each call gets other data, so a result compiled into the graph would show;
a broadcast followed by work must run as one graph, as on a TPU."""

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr


def summed_in_place(t):
    dist.all_reduce(t, dist.ReduceOp.SUM)
    return t


def gathered_into(output, t):
    dist.all_gather_into_tensor(output, t, None)
    return output


def broadcast_cos(t, src):
    return torch.cos(torch.ops._c10d_functional.broadcast(t, src, "default"))


def reduced_then_gathered(t):
    total = xm.all_reduce(xm.REDUCE_SUM, t) + 3.0
    return xm.all_gather(total, dim=0)


def train(index):
    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    cores, rank = xr.world_size(), xr.global_ordinal()
    right, one_graph = 0, 0
    for dynamic in (False, True):
        summed = torch.compile(summed_in_place, backend="openxla", dynamic=dynamic)
        gathered = torch.compile(gathered_into, backend="openxla", dynamic=dynamic)
        broadcast = torch.compile(broadcast_cos, backend="openxla", dynamic=dynamic)
        chained = torch.compile(reduced_then_gathered, backend="openxla", dynamic=dynamic)
        for call in range(3):

            def value(r, call=call):
                return torch.tensor([r + 10.0 * call])

            every = torch.cat([value(r) for r in range(cores)])
            t = value(rank).to(device)
            right += torch.equal(summed(t).cpu(), every.sum().view(1))
            out = torch.zeros(cores, device=device)
            right += torch.equal(gathered(out, value(rank).to(device)).cpu(), every)
            t = value(rank).to(device)
            torch_xla.sync()
            met.clear_all()
            got = broadcast(t, call % cores)
            torch_xla.sync()
            xm.wait_device_ops()  # the graphs run asynchronously: counted once they ran
            one_graph += (met.metric_data("ExecuteTime") or [0])[0] == 1
            right += torch.allclose(got.cpu(), torch.cos(value(call % cores)))
            got = chained(value(rank).to(device)).cpu()
            right += torch.allclose(got, (every.sum() + 3.0).expand(cores))
    met.clear_all()  # what torch_xla counts for the two torch.distributed collectives
    summed(torch.ones(1, device=device))
    gathered(torch.zeros(cores, device=device), torch.ones(1, device=device))
    counted = {"xla::all_reduce", "xla::all_gather_into_tensor"} <= set(met.counter_names())
    print(
        f"rank {rank}: {right} of 24 right, {one_graph} of 6 broadcasts one graph, "
        f"counted {counted}",
        flush=True,
    )


if __name__ == "__main__":
    torch_xla.launch(train)
