"""torch's functional collectives (``torch.ops._c10d_functional``) on simulated cores, eager
and inside ``torch.compile``.

Used only under ``tpunb.simulate``. These ops are what dynamo can trace: ``xm.all_reduce``
of one tensor calls ``_c10d_functional.all_reduce`` (so does ``xm.all_gather``, through
it), and ``torch.compile`` turns ``torch.distributed``'s collectives into them. torch_xla's
XLA kernels for them (``TORCH_LIBRARY_IMPL(_c10d_functional, XLA, m)`` in
https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/cross_replica_reduces.cpp) build
the collective into the rank's graph, past the primitives the simulation replaces: on a
rank process's one-device runtime XLA refuses it (``replica_id < replica_count``). So here:

1. Their XLA kernels are registered again, in Python, calling the primitive with the
   arguments torch_xla's C++ kernel gives the same tensor method (``_xla_all_reduce`` for
   ``all_reduce``, and so on): the host collective runs, as for every other call.
2. A compiled function's collective runs between its compiled graphs, as torch_xla runs
   an op XLA cannot compile. The openxla backend finds such ops when it extracts a graph by
   running each node once (``UnsupportedNodesCollector`` in
   torch_xla/_dynamo/dynamo_bridge.py) and compiles the parts between them
   (``partition_fx_graph_for_cpu_fallback``). While it extracts, these kernels give a
   placeholder of the result's shape (device data, as a fallback op's result is) and
   exchange nothing, and the node that made one is counted among those ops. At every call
   of the compiled function the collective then runs for real, between the graphs.
   On a TPU the collective is inside the compiled graph; the results are the same.
   A graph that takes symbolic numbers (``dynamic=True``) is extracted whole, with no
   parts to run between: one that holds a collective runs as dynamo traced it, its
   operations recorded lazily as outside ``torch.compile`` and run at the next sync, the
   collective between them.
3. ``broadcast``, whose XLA kernel torch_xla writes in Python (``broadcast_xla`` in
   torch_xla/_internal/c10d_registration.py: the source's tensor times 1, the others' times
   0, all-reduced), is one of these kernels too: the backend would otherwise compile its
   all-reduce's result, the first call's, into the graph after it, and every later call
   would return that. Here it gathers every rank's tensor and keeps the source's, so the
   graph before it computes nothing that a TPU's one graph would not (torch_xla counts it
   as the ``xla::all_reduce`` it makes).
4. A part between two collectives that only hands a collective's result on (``copy_`` into
   an argument the function fills, as ``dist.all_gather_into_tensor(out, t)`` compiles to)
   has no work for XLA: the backend hashes its outputs, which are the result's device data,
   compiles nothing (torch_xla compiles only tensors with pending operations), and then
   finds no computation for that hash when it runs ("Failed to get computation by hash").
   Here such a part is hashed and compiled as a copy of those outputs, run at each call.
"""

import functools
import threading
import warnings

import torch

from tpunb.errors import TpunbError

_extraction = threading.local()  # per rank thread: inside the openxla backend's extraction
_library = []  # the registration: kept alive, or torch drops the kernels


def register_kernels():
    """Registers the kernels (point 1), once; the backend's extraction leaves the
    collectives between its graphs through the registry's "collectives_between_graphs" patches
    (point 2)."""
    if _library:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": torch_xla's, on purpose; broadcast's
        # is registered from Python, which torch refuses to override unless told.
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "XLA", allow_override=True)
    _library.append(library)


def copies_compiled(_, extract_graph_helper):
    """The backend's extraction of one part (point 4), in which ``_get_graph_hash`` hashes
    outputs that are all device data as copies of themselves."""

    @functools.wraps(extract_graph_helper)
    def extract_graph_helper_compiling_copies(*args, **kwargs):
        _extraction.part = getattr(_extraction, "part", 0) + 1
        try:
            return extract_graph_helper(*args, **kwargs)
        finally:
            _extraction.part -= 1

    return extract_graph_helper_compiling_copies


def hash_of_copies(_, get_graph_hash):
    import torch_xla

    @functools.wraps(get_graph_hash)
    def get_graph_hash_of_copies(tensors):
        # The backend hashes, then compiles, this same list: copies (two reshapes, which
        # torch_xla records as operations) get compiled where the data alone would not.
        # They read the same device data in the same order: the graph's inputs.
        if (
            getattr(_extraction, "part", 0)
            and tensors
            and not any(torch_xla._XLAC._check_tensor_need_materialization(tensors))
        ):
            tensors[:] = [t.reshape(-1).view(t.shape) for t in tensors]
        return get_graph_hash(tensors)

    return get_graph_hash_of_copies


def extracting(_, extract):
    @functools.wraps(extract)
    def extract_compiled_graph_helper(xla_model, xla_args):
        if _whole(xla_args) and _holds_a_collective(xla_model):
            return xla_model  # point 2: run as traced, op by op
        kept = _Arguments(xla_args)
        _extraction.depth = getattr(_extraction, "depth", 0) + 1
        try:
            compiled = extract(xla_model, xla_args)
        finally:
            _extraction.depth -= 1
            kept.restore()

        def run_compiled(*args):
            from tpunb.simulation import host_collectives

            # A TPU runs the graphs and their collectives as one execution: the results are
            # data when the call returns, not work pending in the step.
            with host_collectives.inside_compiled_graphs():
                return compiled(*args)

        return run_compiled

    return extract_compiled_graph_helper


class _Arguments:
    """A compiled function's tensor arguments, put back after the backend's extraction
    (point 4). The extraction runs the function's parts on the arguments and puts back those
    an operation changed, which it finds as tensors with operations pending
    (``_clear_pending_irs_on_args`` and ``extract_graph_helper`` in dynamo_bridge.py); an
    argument that a part only copied a collective's placeholder into holds the placeholder's
    data, with nothing pending, and kept it: the first call of ``dist.all_reduce(t)``
    compiled gave every rank zeros. So every argument that is data on the device gets its
    data back from the tensor torch_xla hands a graph as that input, which holds the same
    data: nothing to compute."""

    def __init__(self, args):
        import torch_xla

        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type == "xla"]
        pending = torch_xla._XLAC._check_tensor_need_materialization(tensors)
        self.tensors = [t for t, p in zip(tensors, pending, strict=True) if not p]
        data = torch_xla._XLAC._get_tensors_xla_device_data_node
        self.data = [data([t])[1][0] for t in self.tensors]

    def restore(self):
        for tensor, data in zip(self.tensors, self.data, strict=True):
            tensor.copy_(data)


def _whole(xla_args):
    """Whether the backend extracts the graph whole: it does not partition a graph that
    takes symbolic numbers (``extract_compiled_graph_helper`` in dynamo_bridge.py)."""
    return not all(isinstance(arg, torch.Tensor) for arg in xla_args)


def _holds_a_collective(graph_module):
    targets = {getattr(torch.ops._c10d_functional, name).default for name in _KERNELS}
    return any(node.target in targets for node in graph_module.graph.nodes)


def leaving_collectives_out(_, run_node):
    @functools.wraps(run_node)
    def run_node_leaving_collectives_out(self, node):
        _extraction.collecting = getattr(_extraction, "collecting", 0) + 1
        made = getattr(_extraction, "placeholders", 0)
        try:
            result = run_node(self, node)
        finally:
            _extraction.collecting -= 1
        unsupported = getattr(self, "_unsupported_nodes", None)
        between = getattr(_extraction, "placeholders", 0) != made or _waits(node)
        if between and unsupported is not None and node not in unsupported:
            unsupported.append(node)
        return result

    return run_node_leaving_collectives_out


def _waits(node):
    """``wait_tensor``, which ``torch.distributed``'s collectives add under torch.compile:
    compiled into the graph after a collective that ran between graphs, the graph read the
    collective's input instead of its result (``dist.all_reduce(t)`` gave each rank its own
    ``t``). Run between the graphs, next to the collective, it hands on the result."""
    return (
        node.op == "call_function" and node.target is torch.ops._c10d_functional.wait_tensor.default
    )


def _collective(placeholder_shape, counted_as=None):
    """A kernel that runs the collective, or, while the backend extracts a graph, gives a
    placeholder of ``placeholder_shape(input, *args)``. It counts ``xla::`` and its name, as
    torch_xla's C++ kernel counts itself, or ``counted_as``."""

    def decorate(collective):
        counter = counted_as or f"xla::{collective.__name__}"

        @functools.wraps(collective)
        def kernel(tensor, *args):
            import torch_xla

            torch_xla._XLAC._xla_increment_counter(counter, 1)
            if getattr(_extraction, "depth", 0) == 0:
                return collective(tensor, *args)
            if not getattr(_extraction, "collecting", 0):
                raise TpunbError(
                    f"torch.compile's openxla backend traced {collective.__name__} into a "
                    "graph it compiles whole, which simulated cores cannot run: their "
                    "collectives run between compiled graphs. Call the collective outside "
                    "the compiled function, and report this to tpunb."
                )
            _extraction.placeholders = getattr(_extraction, "placeholders", 0) + 1
            shape = placeholder_shape(tensor, *args)
            return torch.zeros(shape, dtype=tensor.dtype).to(tensor.device)

        return kernel

    return decorate


def _same_shape(tensor, *args):
    return tensor.shape


def _gathered(tensor, group_size, group_name):
    return (tensor.shape[0] * group_size, *tensor.shape[1:])


def _scattered(tensor, reduce_op, group_size, group_name):
    return (tensor.shape[0] // group_size, *tensor.shape[1:])


def _all_groups(size):
    return [list(range(size))]


@_collective(_same_shape)
def all_reduce(tensor, reduce_op, group_name):
    import torch_xla

    return torch_xla._XLAC._xla_all_reduce(reduce_op, tensor, 1.0, [], True)


@_collective(_gathered)
def all_gather_into_tensor(tensor, group_size, group_name):
    import torch_xla

    groups = _all_groups(group_size)
    return torch_xla._XLAC._xla_all_gather(tensor, 0, group_size, groups, True, None, None)


@_collective(_scattered)
def reduce_scatter_tensor(tensor, reduce_op, group_size, group_name):
    import torch_xla
    import torch_xla.core.xla_model as xm

    token, context = xm._get_all_reduce_token()
    result, token = torch_xla._XLAC._xla_reduce_scatter(
        reduce_op, tensor, token, 1.0, 0, group_size, _all_groups(group_size), True, None, None
    )
    torch_xla._XLAC._set_all_reduce_token(context.device, token)
    return result


@_collective(_same_shape)
def all_to_all_single(tensor, output_split_sizes, input_split_sizes, group_name):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    split_count = xr.world_size()
    even = tensor.shape[0] // split_count
    if any(size != even for size in [*output_split_sizes, *input_split_sizes]):
        raise RuntimeError("torch_xla does not support arbitrary split sizes for all_to_all")
    token, context = xm._get_all_reduce_token()
    result, token = torch_xla._XLAC._xla_all_to_all(
        tensor, token, 0, 0, split_count, _all_groups(split_count), False
    )
    torch_xla._XLAC._set_all_reduce_token(context.device, token)
    return result


@_collective(_same_shape, counted_as="xla::all_reduce")
def broadcast(tensor, src, group_name):
    """Point 3: every rank's tensor gathered, the source's kept, read back and put on the
    device as data (transfers, no execution), as the graph after it takes a collective's
    result. torch_xla's own kernel broadcasts over every rank, whatever the group (its
    ``ranks`` argument is never given)."""
    import torch_xla
    import torch_xla.runtime as xr

    cores = xr.world_size()
    rows = tensor if tensor.dim() else tensor.reshape(1)
    gathered = torch_xla._XLAC._xla_all_gather(rows, 0, cores, _all_groups(cores), True, None, None)
    kept = gathered.cpu().chunk(cores)[src].reshape(tensor.shape)
    return kept.to(tensor.device)


_KERNELS = {
    "broadcast": broadcast,
    "all_reduce": all_reduce,
    "all_gather_into_tensor": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "all_to_all_single": all_to_all_single,
}
