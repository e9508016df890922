"""What XLA's collectives compute, from every rank's values in rank order: the process
layout's host collectives (host_collectives.py) compute each result so, the same bits on
every rank."""

import torch
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

REDUCE = {
    xm.REDUCE_SUM: torch.add,
    xm.REDUCE_MUL: torch.mul,
    xm.REDUCE_AND: torch.bitwise_and,
    xm.REDUCE_OR: torch.bitwise_or,
    xm.REDUCE_MIN: torch.minimum,
    xm.REDUCE_MAX: torch.maximum,
}


def group_of(groups):
    """The ranks this rank's collective runs among, in the groups' order."""
    rank = xr.global_ordinal()
    if not groups:
        return list(range(xr.world_size()))
    for group in groups:
        if rank in group:
            return list(group)
    raise ValueError(f"rank {rank} is in none of the replica groups {groups}")


def reduced(reduce_type, values, scale):
    """The ranks' ``values`` reduced in rank order, into a new tensor."""
    result, reduce = values[0].clone(), REDUCE[reduce_type]
    for value in values[1:]:
        reduce(result, value, out=result)
    if scale != 1.0:  # as XLA scales: by the scale in the values' own dtype
        result = result * torch.tensor(scale, dtype=result.dtype)
    return result


def each(inputs, shared, group, compute):
    """``compute(values)`` for each input, from the group members' copies of it."""
    return [compute([shared[member][i] for member in group]) for i in range(len(inputs))]
