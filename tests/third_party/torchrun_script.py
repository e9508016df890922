"""A TPU script for torchrun, as torch_xla's own are launched on a TPU VM: torchrun starts
the processes, torch_xla.launch calls the function in each, and torch.distributed finds
the rank through the xla:// init method. With --diverge, rank 0 makes an all-reduce the
other ranks do not."""

import sys

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.runtime as xr


def _mp_fn(index):
    dist.init_process_group("xla", init_method="xla://")
    t = torch.tensor([float(xr.global_ordinal() + 1)], device=torch_xla.device())
    if "--diverge" in sys.argv and xr.global_ordinal() == 0:
        dist.all_reduce(t)  # only rank 0: the others never make this call
    dist.all_reduce(t)
    rank, world = xr.global_ordinal(), xr.world_size()
    print(f"rank {rank} of {world} on {torch_xla.device()}: sum {t.item():g}", flush=True)


if __name__ == "__main__":
    torch_xla.launch(_mp_fn)
