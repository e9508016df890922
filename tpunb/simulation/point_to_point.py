"""Point-to-point between simulated cores, carried through host memory: ``xm.send`` and
``xm.recv``, and a ``collective_permute`` whose pairs name only some of the ranks, which is
what torch.distributed's ``send`` and ``recv`` lower to on the XLA backend (one pair,
``[[sender, receiver]]``, each sender and its receiver making the call, the other ranks
none: ``ProcessGroupXla.send`` in
https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/distributed/xla_backend.py).

Used only under ``tpunb.simulate``. A send and its recv are made by two different ranks,
so they never form the same graph, and XLA's CPU backend has no Send or Recv at all (its
``ThunkEmitter`` emits neither). So a send puts its value in a mailbox and the receiver
takes it from there, in the order sent: the values a TPU would carry, without the XLA op.
The mailboxes are in the meeting's store (host_exchange.py). A permute among some ranks
pairs each receiver with its source by the pair they both name; a receiver given another
shape or dtype than it asked for raises, naming both calls, as ``xm.recv`` does.
"""

import functools
import io
import sys

import torch
import torch_xla.runtime as xr

from tpunb import machine
from tpunb.errors import RankEnded, TpunbError
from tpunb.simulation import host_collectives
from tpunb.watch.collective_calls import among_some, describe, where


def send_recv_through_host(name, _):
    """The registry's maker for ``xm.send`` and ``xm.recv``: this module's."""
    return send if name == "send" else recv


def permute_through_host(_, permute):
    @functools.wraps(permute)
    def collective_permute(input, token, pairs):
        if machine.in_rank() and among_some(pairs, xr.world_size()):
            return permute_among_some(input, token, pairs)
        return permute(input, token, pairs)

    return collective_permute


def send(value: torch.Tensor, channel_id: int) -> torch.Tensor:
    """``xm.send``: the recv with ``channel_id`` on another rank gets ``value``."""
    _post(channel_id, value.detach().cpu())  # runs what the rank traced for it
    return value


def recv(output: torch.Tensor, channel_id: int) -> torch.Tensor:
    """``xm.recv``: a tensor shaped like ``output`` holding what the send with
    ``channel_id`` sent (waits for it)."""
    value = _take(channel_id)
    if value.shape != output.shape or value.dtype != output.dtype:
        raise ValueError(
            f"xm.recv(output, channel_id={channel_id}): the send on this channel sent "
            f"{value.dtype} {list(value.shape)}, and output is {output.dtype} "
            f"{list(output.shape)}. Give recv an output of the shape and dtype sent."
        )
    return value.to(output.device)


def permute_among_some(input, token, pairs):
    """``torch_xla._XLAC._xla_collective_permute`` where its pairs leave out some rank: this rank
    sends ``input`` to each rank it is the source of, and receives from its own source (or
    gets zeros, as XLA gives a rank no pair targets)."""
    rank = xr.global_ordinal()
    call = describe("collective_permute", (input,), {"pairs": [list(p) for p in pairs]})
    frame = sys._getframe(1)
    data = input.detach().cpu()  # runs what the rank traced for it
    for source, target in pairs:
        if source == rank:
            _post(f"permute-{source}-{target}", (call, data))
    sources = [source for source, target in pairs if target == rank]
    if not sources:
        return torch.zeros_like(input), token
    try:
        sent, value = _take(f"permute-{sources[0]}-{rank}", sources[0])
    except RankEnded as ended:
        raise RankEnded(
            f"{call}, called from {where(frame)}, can never complete: the rank that sends to "
            f"it, rank {sources[0]}, will not ({ended}); on a TPU rank {rank} would wait "
            "forever.",
            ended.cause,
        ) from ended.cause
    if sent != call:
        raise ValueError(
            f"Ranks {sources[0]} and {rank} cannot pair up: rank {sources[0]} sent {sent}, "
            f"and rank {rank} received with {call}, called from {where(frame)}. "
            "torch.distributed's send and recv (and xm.collective_permute) need the same "
            "pairs, shape and dtype on both sides (on a TPU these would wait forever)."
        )
    return value.to(input.device), token


def _post(box, value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    _exchange().post(box, buffer.getvalue())


def _take(box, source=None):
    """The first value in the mailbox ``box`` (waits for it); raises ``RankEnded`` once
    the rank ``source``, if given, has ended without sending it."""
    return torch.load(io.BytesIO(_exchange().take(box, source)), weights_only=False)


def _exchange():
    exchange = host_collectives.exchange()
    if exchange is None:
        raise TpunbError(
            "xm.send and xm.recv pass a value from one rank to another, and this process is "
            "no rank of a launch on the simulated cores (one rank alone would wait forever "
            "on a TPU). Call them inside the function xmp.spawn runs, with 2 cores or more."
        )
    return exchange
