"""A TPU script for torchrun, as torch_xla's own are launched on a TPU VM: torchrun starts
the processes, torch_xla.launch calls the function in each, and torch.distributed finds
the rank through the xla:// init method."""

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.runtime as xr


def _mp_fn(index):
    dist.init_process_group("xla", init_method="xla://")
    t = torch.tensor([float(xr.global_ordinal() + 1)], device=torch_xla.device())
    dist.all_reduce(t)
    rank, world = xr.global_ordinal(), xr.world_size()
    print(f"rank {rank} of {world} on {torch_xla.device()}: sum {t.item():g}", flush=True)


if __name__ == "__main__":
    torch_xla.launch(_mp_fn)
