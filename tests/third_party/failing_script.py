"""A TPU script written for torch_xla only, whose rank 3 fails before a collective the
other ranks are already waiting in: xmp.spawn with its default start method (spawn)."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp


def step(index):
    device = torch_xla.device()
    if index == 3:
        raise ValueError("rank 3 found no data")
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device))


if __name__ == "__main__":
    xmp.spawn(step)
