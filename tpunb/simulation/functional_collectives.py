"""torch's functional collectives (``torch.ops._c10d_functional``) on simulated cores, in both
layouts, eager and inside ``torch.compile``.

Used only under ``tpunb.simulate``. These ops are what dynamo can trace: ``xm.all_reduce``
of one tensor calls ``_c10d_functional.all_reduce`` (so does ``xm.all_gather``, through
it), and ``torch.compile`` turns ``torch.distributed``'s collectives into them. torch_xla's
XLA kernels for them (``TORCH_LIBRARY_IMPL(_c10d_functional, XLA, m)`` in
https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/cross_replica_reduces.cpp) build
the collective into the rank's graph, past the primitives each layout replaces: on the
process layout's one-device runtimes XLA refuses it (``replica_id < replica_count``), on
the threads' it runs inside a graph the ranks do not share. So here:

1. Their XLA kernels are registered again, in Python, calling the primitive with the
   arguments torch_xla's C++ kernel gives the same tensor method (``_xla_all_reduce`` for
   ``all_reduce``, and so on): the layout's collective runs, as for every other call.
2. A compiled function's collective runs between its compiled graphs, as torch_xla runs
   an op XLA cannot compile. The openxla backend finds such ops when it extracts a graph by
   running each node once (``UnsupportedNodesCollector`` in
   torch_xla/_dynamo/dynamo_bridge.py) and compiles the parts between them
   (``partition_fx_graph_for_cpu_fallback``). While it extracts, these kernels give a
   placeholder of the result's shape (device data, as a fallback op's result is) and
   exchange nothing, and the node that made one is counted among those ops. At every call
   of the compiled function the collective then runs for real, between the graphs.
   On a TPU the collective is inside the compiled graph; the results are the same.
   A graph of symbolic shapes (``dynamic=True``) is extracted whole, with no parts to run
   between: there the kernel says so, instead of compiling one call's result into it.
"""

import functools
import threading
import warnings

import torch

from tpunb.errors import TpunbError

_extraction = threading.local()  # per rank thread: inside the openxla backend's extraction
_library = []  # the registration: kept alive, or torch drops the kernels


def install():
    """Registers the kernels (point 1) and makes the backend's extraction leave the
    collectives between its graphs (point 2)."""
    import torch_xla._dynamo.dynamo_bridge as bridge

    if _library:
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": torch_xla's, on purpose.
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "XLA")
    _library.append(library)
    bridge.extract_compiled_graph_helper = _extracting(bridge.extract_compiled_graph_helper)
    for collector in (bridge.UnsupportedNodesCollector, bridge.InputCollector):
        collector.run_node = _leaving_collectives_out(collector.run_node)


def _extracting(extract):
    @functools.wraps(extract)
    def extract_compiled_graph_helper(*args, **kwargs):
        _extraction.depth = getattr(_extraction, "depth", 0) + 1
        try:
            return extract(*args, **kwargs)
        finally:
            _extraction.depth -= 1

    return extract_compiled_graph_helper


def _leaving_collectives_out(run_node):
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


def _collective(placeholder_shape):
    """A kernel that runs the collective, or, while the backend extracts a graph, gives a
    placeholder of ``placeholder_shape(input, *args)``."""

    def decorate(collective):
        counter = f"xla::{collective.__name__}"  # as torch_xla's C++ kernel counts itself

        @functools.wraps(collective)
        def kernel(tensor, *args):
            import torch_xla

            torch_xla._XLAC._xla_increment_counter(counter, 1)
            if getattr(_extraction, "depth", 0) == 0:
                return collective(tensor, *args)
            if not getattr(_extraction, "collecting", 0):
                raise TpunbError(
                    f"torch.compile traced {collective.__name__} into a graph of symbolic "
                    "shapes, which simulated cores cannot run: their collectives run between "
                    "compiled graphs. Compile with dynamic=False (torch.compile(..., "
                    "dynamic=False)), or call the collective outside the compiled function."
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


_KERNELS = {
    "all_reduce": all_reduce,
    "all_gather_into_tensor": all_gather_into_tensor,
    "reduce_scatter_tensor": reduce_scatter_tensor,
    "all_to_all_single": all_to_all_single,
}
