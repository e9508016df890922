"""``limit_graphs(step, max_graphs)``: a step function that fails fast, with the shapes
that caused it, once it would need more than ``max_graphs`` compiled graphs, instead of
compiling one graph after another for minutes."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable

from tpunb.errors import TpunbError, check_count
from tpunb.machine import cores

T = typing.TypeVar("T")

_FIX = (
    "Give the step fixed shapes: pad sequences to a few lengths "
    "(collate_fn=tpunb.BucketCollate(tpunb.choose_buckets(lengths, 4))) and drop or pad the "
    "short last batch (drop_last=True), or raise max_graphs if the shapes are expected."
)


def limit_graphs(step: Callable[..., T], max_graphs: int) -> Callable[..., T]:
    """Inside a launched function: ``step`` wrapped so that a call needing graph number
    ``max_graphs + 1`` raises TpunbError.

    Where each process runs one rank (TPU v4, v5e, v6e, and ``cores=1``) this is
    ``torch_xla.compile(step, max_different_graphs=max_graphs)``, which compares traced
    graphs. Where ranks share a process (v2-8, v3-8 and the simulated cores), torch_xla's
    detector is one per process and breaks across threads (it failed with "Check failed:
    IsSessionActive()" on 8 simulated cores), so tpunb counts the distinct shapes and
    dtypes of the step's tensor arguments instead: the cause the limit exists for.

    Args:
        step: the training step, called with the batch's tensors.
        max_graphs: how many different graphs it may compile.

    Returns:
        ``step``, wrapped.
    """
    check_count(max_graphs, "limit_graphs(step, max_graphs=...)", "graphs", 4)
    if not cores.in_rank():
        raise TpunbError(
            "limit_graphs(step, ...) wraps a step inside the function given to tpunb.launch: "
            "graphs are compiled by the ranks."
        )
    name = getattr(step, "__qualname__", repr(step))
    if cores.ranks_in_this_process() == 1:
        return _with_torch_xla_detector(step, max_graphs, name)
    return _by_input_shapes(step, max_graphs, name)


def _with_torch_xla_detector(step, max_graphs, name):
    import torch_xla

    compiled = torch_xla.compile(step, max_different_graphs=max_graphs)

    @functools.wraps(step)
    def limited(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except RuntimeError as error:
            if "Maximum number of different graphs" not in str(error):
                raise
            raise TpunbError(
                f"{name} needed more than {max_graphs} different graphs "
                f"(limit_graphs(..., max_graphs={max_graphs})). torch_xla says: {error}\n{_FIX}"
            ) from error

    return limited


def _by_input_shapes(step, max_graphs, name):
    seen = {}

    @functools.wraps(step)
    def limited(*args, **kwargs):
        key = _signature((args, kwargs))
        if key not in seen:
            if len(seen) == max_graphs:
                before = "; ".join(_describe(k) for k in seen)
                raise TpunbError(
                    f"{name} was called with input shapes {_describe(key)}, a graph beyond the "
                    f"{max_graphs} allowed (limit_graphs(..., max_graphs={max_graphs})); the "
                    f"shapes seen before: {before}.\n{_FIX}"
                )
            seen[key] = None
        return step(*args, **kwargs)

    return limited


class _Tensor(typing.NamedTuple):
    shape: tuple
    dtype: str

    def __str__(self):
        return f"{self.dtype}{list(self.shape)}"


def _signature(value):
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return _Tensor(tuple(shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, dict):
        return tuple(_signature(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return None


def _describe(key):
    def tensors(item):
        if isinstance(item, _Tensor):
            yield item
        elif isinstance(item, tuple):
            for part in item:
                yield from tensors(part)

    return ", ".join(map(str, tensors(key))) or "no tensors"
