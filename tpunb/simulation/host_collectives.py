"""Collectives between the processes of simulated cores, computed on the host.

Used only by the simulation's rank processes (rank_processes.py). Each has one XLA CPU
device, and torch_xla's CPU client has no collectives between processes (it starts the
client with no distributed options: ``InitializeCpu`` in
https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/runtime/pjrt_registry.cpp). So
each primitive that every Python collective reaches (registry.COLLECTIVE_PRIMITIVES; xm.all_reduce
of one tensor reaches ``torch.ops._c10d_functional.all_reduce`` and is sent to
``_xla_all_reduce`` here) is replaced by one that:

1. runs what the rank has traced so far (a cut: a step becomes two graphs, where a TPU runs
   one), so the inputs are data
   on the device, and reads them to the host in one transfer;
2. shares them with every rank (host_exchange.py), with the call's identity
   (watch/collective_calls.py): ranks whose calls differ wait, as on a TPU, for the verdict
   of the judge of the ranks' calls;
3. computes its result as XLA defines the collective (reduction, groups, scale, shards) from
   the ranks' inputs in rank order, so every rank computes the same bits;
4. puts the result on the device: a new tensor, or the outputs written in place.

The token torch_xla threads through its collectives to order them is handed back as it
came: the host has already ordered them.
"""

import contextlib
import dataclasses
import functools
import inspect
import sys

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla.core import xla_builder

from tpunb.errors import RankEnded
from tpunb.upstream import patching
from tpunb.watch import collective_calls
from tpunb.watch.collective_calls import identity

# The counters torch_xla's C++ primitives count as they trace (each binding's
# TORCH_LAZY_FN_COUNTER_TIMED_TRACING("xla::") in
# https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/init_python_bindings.cpp), which
# programs and torch_xla's tests look for in met.counter_names(): counted here too.
_COUNTERS = {
    "_xla_all_reduce_inplace": "xla::AllReduceInPlace",
    "_xla_all_reduce": "xla::AllReduce",
    "_xla_reduce_scatter": "xla::ReduceScatter",
    "_xla_reduce_scatter_out": "xla::ReduceScatterOut",
    "_xla_all_gather": "xla::AllGather",
    "_xla_all_gather_out": "xla::AllGatherOut",
    "_xla_all_to_all": "xla::AllToAll",
}


@dataclasses.dataclass
class _Rank:
    """This process as a rank: the meeting it shares its collectives through, how many
    steps and collectives it has made (its messages name them), and the values its cuts
    computed early in this step (``pending_on_a_tpu``)."""

    exchange: object  # host_exchange.Exchange
    steps: int = 1
    collectives: int = 0
    # torch_xla numbers its tensors as it makes them (``_xla_get_tensor_id``): those made
    # after ``step_from`` and before ``early_to`` were pending at this step's cuts, or are
    # its collectives' results, unless they were data already (a transfer) or a read has
    # computed them (``read``).
    step_from: int = 0
    early_to: int = 0
    cut_ran: bool = False  # a cut of this step ran pending work
    compiled: int = 0  # inside a torch.compile'd function's graphs: results are data
    read: set = dataclasses.field(default_factory=set)
    copied: set = dataclasses.field(default_factory=set)  # copied to the device: data

    def record(self, name, args, kwargs, frame):
        """A collective call, before it runs, in the meeting's ledger."""
        self.exchange.record(self.steps, name, args, kwargs, frame)


_rank: _Rank | None = None  # this process's, once it is a rank


def start(exchange):
    """This process is a rank, meeting the others through ``exchange`` (None: no more)."""
    global _rank
    _rank = _Rank(exchange) if exchange is not None else None


def exchange():
    """The meeting of this rank process, or None outside one."""
    return _rank.exchange if _rank is not None else None


def calls_recorded():
    """For the duration: this rank's collective calls go to the meeting's ledger, where the
    meeting judges them (a meeting judges where no launch records the calls itself)."""
    if _rank.exchange.ledger is None:
        return contextlib.nullcontext()
    return collective_calls.recorded(_rank.record)


def _step_ended(caller):
    """After a sync: counts the rank's steps; the next step has computed nothing early."""
    if _rank is not None:
        _rank.steps += 1
        _rank.step_from, _rank.early_to = _next_tensor_id(), 0
        _rank.cut_ran = False
        _rank.read.clear()
        # In place, as the loader's thread may add to it now (a copy is taken whole).
        _rank.copied -= {number for number in _rank.copied.copy() if number <= _rank.step_from}


@contextlib.contextmanager
def inside_compiled_graphs():
    """For the duration: a compiled function's graphs run, whose collectives' results a TPU
    has computed when the function returns (it runs them inside one execution)."""
    if _rank is None:
        yield
        return
    _rank.compiled += 1
    try:
        yield
    finally:
        _rank.compiled -= 1


def _next_tensor_id():
    """The number torch_xla gives the next tensor it makes: from a placeholder, which has no
    buffer and counts no op (torch_xla's own helper, used to stage out HLO)."""
    placeholder = xla_builder.create_placeholder_tensor((), torch.bool)
    return torch_xla._XLAC._xla_get_tensor_id(placeholder) + 1


def pending_on_a_tpu(_, upstream):
    """The registry's maker for ``launcher.reads.pending_on_a_tpu``: a TPU's answer in a rank
    process. A value this step made before a collective, which the cut before it computed,
    or the collective's result, is still to compute on a TPU, whose collective is inside
    the step's graph: a read of it (``total += loss.item()`` after ``xm.optimizer_step``,
    the weights' update pending beside it) cuts the step there, and not here. A value that
    was data already (copied to the device) is taken for one of them (docs/simulation.md)."""

    def as_on_a_tpu(tensor, pending):
        if _rank is None or not (pending or _rank.cut_ran):
            return upstream(tensor, pending)
        number = torch_xla._XLAC._xla_get_tensor_id(tensor)
        early = _rank.step_from < number < _rank.early_to
        early = early and number not in _rank.read and number not in _rank.copied
        if pending or early:
            _rank.read.add(number)  # computed by this read, as a TPU's read computes it
        return pending or early

    return as_on_a_tpu


def copies_recorded(_, tensors_from_aten):
    """The registry's maker for torch_xla's copy of host tensors to the device (what
    ``xm.send_cpu_data_to_device`` and so torch_xla's loaders call): in a rank process, the
    copies' numbers are kept, data before any collective of the step (``pending_on_a_tpu``).
    A tensor made with ``.to(device)`` or ``torch.tensor(..., device=...)`` is copied in
    torch_xla's C++ and is not seen here (docs/simulation.md)."""

    @functools.wraps(tensors_from_aten)
    def copy_recorded(*args, **kwargs):
        copies = tensors_from_aten(*args, **kwargs)
        if _rank is not None:  # the loader's thread too: the set takes its adds whole
            _rank.copied.update(map(torch_xla._XLAC._xla_get_tensor_id, copies))
        return copies

    return copy_recorded


def host_primitive(name, original):
    """The registry's maker: the primitive ``name`` on the host in a rank process."""
    implementation = _PRIMITIVES[name]

    @functools.wraps(original)
    def primitive(*args, **kwargs):
        if _rank is None:
            return original(*args, **kwargs)
        return _on_the_host(name, identity(name, args, kwargs), implementation, args, kwargs)

    return primitive


# torch.compile runs the call between the graphs it compiles (torch._dynamo.disable).
@torch._dynamo.disable
def _on_the_host(name, call, implementation, args, kwargs):
    """Primitive ``name``'s ``implementation``, counted as torch_xla counts it, the call
    ``call`` its identity (``collective_calls.identity``)."""
    if name in _COUNTERS:
        torch_xla._XLAC._xla_increment_counter(_COUNTERS[name], 1)
    return implementation(call, *args, **kwargs)


def host_all_reduce(_, all_reduce):
    """The registry's maker for ``xm.all_reduce``: one tensor goes to ``_xla_all_reduce``'s
    implementation, described in xm.all_reduce's words. Under torch.compile, dynamo traces
    xm.all_reduce itself: its ``torch.ops._c10d_functional.all_reduce`` runs between the
    compiled graphs (functional_collectives.py)."""
    signature = inspect.signature(all_reduce)  # read once: bound at every call

    @functools.wraps(all_reduce)
    def all_reduce_one_tensor_too(reduce_type, inputs, *args, **kwargs):
        if _rank is None or torch.compiler.is_compiling() or not torch.is_tensor(inputs):
            return all_reduce(reduce_type, inputs, *args, **kwargs)
        given = signature.bind(reduce_type, inputs, *args, **kwargs)
        given.apply_defaults()
        scale, groups, pin = (given.arguments[k] for k in ("scale", "groups", "pin_layout"))
        call = identity("all_reduce", (reduce_type, inputs, *args), kwargs)
        primitive = (reduce_type, inputs, scale, groups or [], pin)
        return _on_the_host("_xla_all_reduce", call, _PRIMITIVES["_xla_all_reduce"], primitive, {})

    return all_reduce_one_tensor_too


def _share(call, tensors):
    """Steps 1 and 2: every rank's ``tensors``, as CPU tensors, in rank order, once every
    rank's ``call`` (its identity) is this one's."""
    # Where an input is still to compute, the step's pending work runs (what the step
    # marker runs), but no step ends: a step marker would also count a MarkStep, advance
    # torch_xla's random seed and close the user's profiler scopes, where on a TPU the
    # collective is inside the step. Where the inputs are data, nothing runs: the pending
    # work stays in the step's graph, as on a TPU (an all-reduce of the loss after
    # xm.optimizer_step leaves the weights' update there).
    if any(torch_xla._XLAC._check_tensor_need_materialization(tensors)):
        device = torch_xla._XLAC._xla_get_default_device()
        _rank.cut_ran = True
        torch_xla._XLAC._xla_sync_live_tensors(device, [], wait=False)
    host = [t.contiguous() for t in torch_xla._XLAC._xla_get_cpu_tensors(tensors)]
    exchange = _rank.exchange
    _rank.collectives += 1
    number, step = _rank.collectives, _rank.steps
    frame = sys._getframe(2)
    try:
        calls, data = exchange.share(call, [_bytes(t) for t in host])
        if any(other != call for other in calls):
            exchange.await_verdict()
    except RankEnded as ended:
        raise RankEnded(
            f"{call}, called from {collective_calls.where(frame)} (collective number {number}, "
            f"step {step}), can never complete: rank {ended.rank} has ended (it {ended.how}). "
            f"A collective needs every rank; on a TPU the others would wait for rank "
            f"{ended.rank} forever.",
            ended.cause,
        ) from ended.cause
    return [_tensors(shared, host) for shared in data]


def _bytes(tensor):
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _tensors(shared, like):
    """The tensors in a rank's shared bytes, shaped as this rank's ``like``: views of the
    shared memory, to be read before this rank's next round but one."""
    tensors, offset = [], 0
    for tensor in like:
        size = tensor.numel() * tensor.element_size()
        raw = torch.from_numpy(shared[offset : offset + size])  # shared memory, not a copy
        tensors.append(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += size
    return tensors


def _to_device(tensors):
    """The host ``tensors`` on this rank's device, in one transfer. In eager mode, where a
    TPU runs the collective as one eager computation (counted in ``EagerOpExecuteTime``,
    as pytorch/xla's test_eager_all_reduce_in_place.py checks), they arrive through one too."""
    device = torch_xla._XLAC._xla_get_default_device()
    # torch_xla's own copy: the results are the collective's, not copies of the program's,
    # which ``copies_recorded`` keeps.
    copy = patching.upstream(torch_xla._XLAC._xla_tensors_from_aten)
    on_device = copy(tensors, [device] * len(tensors), None)
    if not torch_xla._XLAC._get_use_eager_mode():
        if _rank.cut_ran and not _rank.compiled:  # to compute on a TPU, like the cut's values
            _rank.early_to = _next_tensor_id()
        return on_device
    torch_xla._XLAC._set_use_eager_mode(False)  # traced together, then run as one eager op
    try:
        kept = torch.tensor(True, device=device)
        results = [torch.where(kept, tensor, tensor) for tensor in on_device]
    finally:
        torch_xla._XLAC._set_use_eager_mode(True)
    torch_xla._XLAC._xla_sync_multi(results, [], wait=False)
    return results


@torch.no_grad()
def _write(outputs, results):
    """Each of ``outputs`` holds its result, in place (through torch's ``copy_``, so views,
    aliases and a parameter's version counter see it), from one transfer: the in-place
    forms (``_xla_all_reduce_inplace``), whose XLA op writes into its inputs."""
    for output, result in zip(outputs, _to_device(results), strict=True):
        output.copy_(result)


def _become(outputs, results):
    """Each of ``outputs`` becomes its result, whatever its shape was, from one transfer: the
    ``out=`` forms, whose XLA op gives the output the collective's value
    (``XLATensor::SetIrValue`` in tensor_methods.cpp, e.g. a full-size output of
    ``xm.reduce_scatter(..., output=[...])`` holds its shard after the call)."""
    for output, result in zip(outputs, _to_device(results), strict=True):
        torch_xla._XLAC._replace_xla_tensor(output, result)


# What XLA's collectives compute, from every rank's values in rank order: each result so,
# the same bits on every rank.
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


# The primitives, by their torch_xla signatures (init_python_bindings.cpp, v2.9.0), each
# after the call in words (``_on_the_host``).


def all_reduce(call, reduce_type, inputs, scale, groups, pin_layout):
    return _to_device(_all_reduced(call, reduce_type, [inputs], scale, groups))[0]


def all_reduce_inplace(call, reduce_type, inputs, scale, groups, pin_layout):
    _write(inputs, _all_reduced(call, reduce_type, inputs, scale, groups))


def _all_reduced(call, reduce_type, inputs, scale, groups):
    reduce = functools.partial(reduced, reduce_type, scale=scale)
    return each(inputs, _share(call, inputs), group_of(groups), reduce)


def _gathered(call, inputs, dim, groups):
    return each(
        inputs, _share(call, inputs), group_of(groups), lambda values: torch.cat(values, dim)
    )


def all_gather(call, input, dim, shard_count, groups, pin_layout, channel_id=None, ids=None):
    return _to_device(_gathered(call, [input], dim, groups))[0]


def all_gather_out(call, output, input, token, dim, shard_count, groups, pin_layout):
    _become([output], _gathered(call, [input], dim, groups))
    return token


def all_gather_coalesced(call, tensors, token, dim, shard_count, groups, pin_layout):
    return [*_to_device(_gathered(call, tensors, dim, groups)), token]


def all_gather_coalesced_out(call, outputs, inputs, token, dim, shard_count, groups, pin_layout):
    _become(outputs, _gathered(call, inputs, dim, groups))
    return token


def _scattered(call, reduce_type, inputs, scale, dim, shard_count, groups):
    shared = _share(call, inputs)
    group = group_of(groups)
    index = group.index(xr.global_ordinal())

    def shard(values):
        whole = reduced(reduce_type, values, scale)
        size = whole.shape[dim] // shard_count
        return whole.narrow(dim, index * size, size).contiguous()

    return each(inputs, shared, group, shard)


def reduce_scatter(
    call, reduce_type, input, token, scale, dim, shard_count, groups, pin_layout, *ids
):
    return _to_device(_scattered(call, reduce_type, [input], scale, dim, shard_count, groups))[
        0
    ], token


def reduce_scatter_out(
    call, reduce_type, output, input, token, scale, dim, shard_count, groups, pin
):
    _become([output], _scattered(call, reduce_type, [input], scale, dim, shard_count, groups))
    return token


def reduce_scatter_coalesced(
    call, reduce_type, inputs, token, scale, dim, shard_count, groups, pin
):
    return [
        *_to_device(_scattered(call, reduce_type, inputs, scale, dim, shard_count, groups)),
        token,
    ]


def reduce_scatter_coalesced_out(
    call, reduce_type, outputs, inputs, token, scale, dim, shard_count, groups, pin
):
    _become(outputs, _scattered(call, reduce_type, inputs, scale, dim, shard_count, groups))
    return token


def all_to_all(call, input, token, split_dim, concat_dim, split_count, groups, pin_layout):
    shared = _share(call, [input])
    group = group_of(groups)
    index = group.index(xr.global_ordinal())
    size = input.shape[split_dim] // split_count
    pieces = [shared[member][0].narrow(split_dim, index * size, size) for member in group]
    return _to_device([torch.cat(pieces, concat_dim)])[0], token


def collective_permute(call, input, token, pairs):
    shared = _share(call, [input])
    rank = xr.global_ordinal()
    sources = [source for source, target in pairs if target == rank]
    result = shared[sources[0]][0].clone() if sources else torch.zeros_like(shared[rank][0])
    return _to_device([result])[0], token


_PRIMITIVES = {
    "_xla_all_reduce": all_reduce,
    "_xla_all_reduce_inplace": all_reduce_inplace,
    "_xla_all_gather": all_gather,
    "_xla_all_gather_out": all_gather_out,
    "_xla_all_gather_coalesced": all_gather_coalesced,
    "_xla_all_gather_coalesced_out": all_gather_coalesced_out,
    "_xla_reduce_scatter": reduce_scatter,
    "_xla_reduce_scatter_out": reduce_scatter_out,
    "_xla_reduce_scatter_coalesced": reduce_scatter_coalesced,
    "_xla_reduce_scatter_coalesced_out": reduce_scatter_coalesced_out,
    "_xla_all_to_all": all_to_all,
    "_xla_collective_permute": collective_permute,
}
# The simulation's work at each sync (registry.SIMULATION_STEP_HOOKS).
STEP_HOOKS = {"after": _step_ended}
