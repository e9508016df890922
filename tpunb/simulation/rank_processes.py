"""One process a simulated core, as on a TPU v5e-8 (8 processes of one chip each).

Used only under ``tpunb.simulate``. ``simulate`` describes a host whose
processes hold one chip each (``TPU_PROCESS_BOUNDS``, tpu_host.py), so torch_xla's own
``xmp.spawn`` starts one process a core (``run_multiprocess``), forked or spawned. Here:

- in the launching process, ``run_multiprocess`` opens the meeting the ranks' collectives
  use (host_exchange.py) before the processes start, and closes it, unlinking what they
  left, once they have ended;
- in each rank process, before torch_xla's runtime starts: its runtime gets one CPU
  device (``xla:0``), and torch_xla's world size and ordinal are set as a v5e-8 process's
  are (torch_xla reads them from its runtime only where the runtime is the TPU's, whose
  devices span the processes); ``xr.process_index()``, ``xr.process_count()`` and the
  global device counts answer as there. torch's intra-op threads are one (OpenMP's
  threads hang in a process forked from one that ran them). Then the rank joins the
  meeting, runs with its collective calls recorded for the meeting's judge (unless a
  launch records them), and says when it ends (host_exchange.py).

A rank process's metrics, counters, random generator, dynamo and torch.distributed state
are its own, as on a TPU: nothing else is patched for them.
"""

import functools
import os

from tpunb.errors import RankEnded
from tpunb.simulation import host_collectives, host_exchange, pitfalls, tpu_host
from tpunb.upstream import registry

_PROCESS_RANK, _PROCESS_COUNT = "PJRT_LOCAL_PROCESS_RANK", "PJRT_LOCAL_PROCESS_COUNT"


# The registry's makers (its "processes" entries).
def run_in_meeting(_, run_multiprocess):
    @functools.wraps(run_multiprocess)
    def run_in_a_meeting(fn, *args, start_method="spawn", **kwargs):
        from torch_xla._internal import tpu

        # The meeting judges the ranks' collective calls, unless a launch does.
        judging = not registry.active("collective_ledger")
        ranks = tpu.num_local_processes()
        with (
            host_exchange.meeting(ranks, judging) as meeting,
            pitfalls.launch_watched(ranks, meeting),
        ):
            return run_multiprocess(fn, *args, start_method=start_method, **kwargs)

    return run_in_a_meeting


def run_as_rank_process(_, run_threads):
    # Keeps the name: xmp.spawn sends it to its processes by name.
    @functools.wraps(run_threads)
    def run_thread_per_device(local_rank, local_world_size, fn, initializer_fn):
        exchange = become_rank(local_rank, local_world_size)

        @functools.wraps(fn)
        def rank():
            try:
                with pitfalls.rank_watched(local_rank):
                    result = fn()
            except BaseException as error:
                exchange.end(error)
                raise
            exchange.end(None)
            return result

        try:
            exchange.join()
            with host_collectives.calls_recorded():
                results = run_threads(local_rank, local_world_size, rank, initializer_fn)
            # Keyed by the device's ordinal in its process (0); on a TPU by its global one.
            (result,) = results.values()
            return {local_rank: result}
        except RankEnded as stopped:
            # A rank stopped by another's end raises that rank's exception, as xmp.spawn
            # would raise the failing rank's.
            if stopped.cause is None:
                raise
            raise stopped.cause from None
        finally:
            host_collectives.start(None)
            exchange.close()

    return run_thread_per_device


def become_rank(local_rank, local_world_size, address=None):
    """Makes this process, before its runtime starts, rank ``local_rank`` of
    ``local_world_size`` as a v5e-8's process is, with its side of the meeting at
    ``address`` (the launching process's, in the environment, by default)."""
    import torch

    tpu_host.runtime_reads_cpu()  # one CPU device: this process's chip
    registry.install("v5e_world_and_ordinal", local_world_size, local_rank)
    os.environ.setdefault(_PROCESS_RANK, str(local_rank))
    os.environ.setdefault(_PROCESS_COUNT, str(local_world_size))
    # One intra-op thread: a forked process whose parent ran torch's OpenMP threads
    # hangs in its first parallel region with more than one (libgomp is not fork-safe:
    # https://github.com/pytorch/pytorch/issues/17199); a notebook that computed on the
    # CPU before the launch has run them. The device's work runs on XLA's own threads.
    torch.set_num_threads(1)
    exchange = host_exchange.Exchange(local_rank, local_world_size, address)
    host_collectives.start(exchange)
    return exchange


def global_device_count(_, global_runtime_device_count):
    import torch_xla.runtime as xr

    @functools.wraps(global_runtime_device_count)
    def global_device_count():
        if host_collectives.exchange() is None:  # the launching process: every chip its own
            return global_runtime_device_count()
        return xr.global_device_count()

    return global_device_count


def v5e_answer(name, original):
    @functools.wraps(original)
    def answer():
        if host_collectives.exchange() is None:  # not in a rank process
            return original()
        if name == "process_index":
            return int(os.environ[_PROCESS_RANK])
        return int(os.environ[_PROCESS_COUNT])  # process_count, global_device_count

    return answer
