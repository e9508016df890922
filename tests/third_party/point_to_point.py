"""A TPU script written for torch_xla 2.9 only: point-to-point with torch.distributed's XLA
backend, which lowers ``dist.send`` and ``dist.recv`` to a ``collective_permute`` of one
pair. A pipeline (each rank a stage: it receives the activations from the rank before,
computes, and sends them on) and a ring exchange (even ranks send first, odd ranks receive
first). Then, with ``--mismatch``, rank 1 receives with a tensor of the wrong shape."""

import sys

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.distributed.xla_backend  # noqa: F401 (registers the "xla" backend)
import torch_xla.runtime as xr


def stage(x, rank):
    return x * 2 + rank


def _mp_fn(index, mismatch):
    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    world, rank = xr.world_size(), xr.global_ordinal()

    # The pipeline: rank 0 starts it, the last rank checks what arrives.
    shape = (3, 4) if mismatch and rank == 1 else (2, 4)
    if rank == 0:
        x = stage(torch.arange(8.0).view(2, 4).to(device), rank)
    else:
        x = torch.zeros(shape, device=device)
        dist.recv(x, src=rank - 1)
        x = stage(x, rank)
    if rank < world - 1:
        dist.send(x, dst=rank + 1)
    torch_xla.sync()
    expected = torch.arange(8.0).view(2, 4)
    for r in range(world):
        expected = stage(expected, r)
    pipeline = rank < world - 1 or torch.equal(x.cpu(), expected)

    # The ring: each rank sends its rank to the next and receives the previous one's.
    mine = torch.full((4,), float(rank), device=device)
    got = torch.zeros(4, device=device)
    after, before = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        dist.send(mine, dst=after)
        dist.recv(got, src=before)
    else:
        dist.recv(got, src=before)
        dist.send(mine, dst=after)
    ring = torch.equal(got.cpu(), torch.full((4,), float(before)))
    print(
        f"rank {rank}: pipeline {'right' if pipeline else 'WRONG'}, ring "
        f"{'right' if ring else 'WRONG'}",
        flush=True,
    )


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=("--mismatch" in sys.argv,))
