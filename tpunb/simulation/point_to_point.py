"""``xm.send`` and ``xm.recv`` between simulated cores, carried through host memory.

Used only under ``tpunb.simulate``. A send and its recv are made by two different ranks,
so they never form the same graph, and XLA's CPU backend has no Send or Recv at all (its
``ThunkEmitter`` emits neither). So a send puts its value in a mailbox named by the channel
id and the recv with that channel id takes it from there, in the order sent: the values a
TPU would carry, without the XLA op. On the threads the mailboxes are in the process's
memory; on the processes in the meeting's store (host_exchange.py).
"""

import collections
import functools
import io
import threading

import torch
import torch_xla.core.xla_model as xm

from tpunb.simulation import host_collectives

_mailboxes = collections.defaultdict(collections.deque)
_arrived = threading.Condition()


def install():
    xm.send, xm.recv = send, recv


def send(value: torch.Tensor, channel_id: int) -> torch.Tensor:
    """``xm.send``: the recv with ``channel_id`` on another rank gets ``value``."""
    copy = value.detach().cpu()  # runs what the rank traced for it
    exchange = host_collectives.exchange()
    if exchange is not None:
        buffer = io.BytesIO()
        torch.save(copy, buffer)
        exchange.post(channel_id, buffer.getvalue())
        return value
    with _arrived:
        _mailboxes[channel_id].append(copy)
        _arrived.notify_all()
    return value


def recv(output: torch.Tensor, channel_id: int) -> torch.Tensor:
    """``xm.recv``: a tensor shaped like ``output`` holding what the send with
    ``channel_id`` sent (waits for it)."""
    exchange = host_collectives.exchange()
    if exchange is not None:
        value = torch.load(io.BytesIO(exchange.take(channel_id)))
    else:
        with _arrived:
            _arrived.wait_for(functools.partial(bool, _mailboxes[channel_id]))
            value = _mailboxes[channel_id].popleft()
    if value.shape != output.shape or value.dtype != output.dtype:
        raise ValueError(
            f"xm.recv(output, channel_id={channel_id}): the send on this channel sent "
            f"{value.dtype} {list(value.shape)}, and output is {output.dtype} "
            f"{list(output.shape)}. Give recv an output of the shape and dtype sent."
        )
    return value.to(output.device)
