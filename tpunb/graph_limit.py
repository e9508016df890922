"""``limit_graphs(step, max_graphs)``: a step function that fails fast, with torch_xla's
message and the fix, once it would need more than ``max_graphs`` compiled graphs, instead
of compiling one graph after another for minutes."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable

from tpunb import machine
from tpunb.errors import TpunbError, check_count

T = typing.TypeVar("T")

_FIX = (
    "Give the step fixed shapes: pad sequences to a few lengths "
    "(collate_fn=tpunb.BucketCollate(tpunb.choose_buckets(lengths, 4))) and drop or pad the "
    "short last batch (drop_last=True), or raise max_graphs if the shapes are expected."
)


def limit_graphs(step: Callable[..., T], max_graphs: int) -> Callable[..., T]:
    """Inside a launched function: ``step`` wrapped so that a call needing graph number
    ``max_graphs + 1`` raises TpunbError.

    This is ``torch_xla.compile(step, max_different_graphs=max_graphs)``, which compares
    traced graphs, with tpunb's error: each rank runs in a process of its own, and
    torch_xla's detector is one a process.

    Args:
        step: the training step, called with the batch's tensors.
        max_graphs: how many different graphs it may compile.

    Returns:
        ``step``, wrapped.
    """
    check_count(max_graphs, "limit_graphs(step, max_graphs=...)", "graphs", 4)
    if not machine.in_rank():
        raise TpunbError(
            "limit_graphs(step, ...) wraps a step inside the function given to tpunb.launch: "
            "graphs are compiled by the ranks."
        )
    import torch_xla

    name = getattr(step, "__qualname__", repr(step))
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
