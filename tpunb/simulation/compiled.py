"""torch.compile in the ranks of a simulation, which are threads of one process.

Used only under ``tpunb.simulate``. Two pieces of state that torch and torch_xla keep per
process are per rank on a TPU host (a process a rank) and shared here:

1. torch.fx's "symbolic tracing under way" flag (``_is_fx_tracing_flag`` in
   torch/fx/_symbolic_trace.py, a module global). While one rank's compilation traces, a
   call of a compiled function in another rank sees the flag and raises "Detected that you
   are using FX to symbolically trace a dynamo-optimized function". Here the flag counts
   only in the thread that traces.
2. torch_xla's counters. The openxla backend extracts each compiled graph when it first
   runs, and the extraction clears the process's counters to find the ops that
   fall back to the CPU, then puts two of them back (``UnsupportedNodesCollector`` in
   torch_xla/_dynamo/dynamo_bridge.py): ranks extracting at once read a counter another
   has just cleared (``TypeError: _xla_increment_counter(): incompatible function arguments
   ... 'DynamoExtractCompiledGraph', None``). Here the ranks extract one at a time.

What is not done yet: a compiled *model* trained with backward (AOT autograd) still fails in
some runs; its compiled forward and backward are shared by the ranks and raced on.

Collectives inside a compiled function run between the graphs compiled before and after
them (collectives.py), as their own graph.
"""

import functools
import threading

_extract_lock = threading.Lock()
_tracing = threading.local()


def install():
    import torch.fx._symbolic_trace as symbolic_trace
    import torch_xla._dynamo.dynamo_bridge as bridge

    if getattr(bridge.extract_compiled_graph, "one_rank_at_a_time", False):
        return
    bridge.extract_compiled_graph = _one_at_a_time(bridge.extract_compiled_graph)
    tracer = symbolic_trace.Tracer
    tracer.trace = _marking_this_thread(tracer.trace)
    # torch 2.9's dynamo asks is_fx_symbolic_tracing, torch 2.8's is_fx_tracing.
    for name in ("is_fx_tracing", "is_fx_symbolic_tracing"):
        if hasattr(symbolic_trace, name):
            setattr(symbolic_trace, name, _in_this_thread(getattr(symbolic_trace, name)))


def _one_at_a_time(extract):
    @functools.wraps(extract)
    def extract_compiled_graph(*args, **kwargs):
        with _extract_lock:
            return extract(*args, **kwargs)

    extract_compiled_graph.one_rank_at_a_time = True
    return extract_compiled_graph


def _marking_this_thread(trace):
    @functools.wraps(trace)
    def marked_trace(*args, **kwargs):
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            return trace(*args, **kwargs)
        finally:
            _tracing.depth -= 1

    return marked_trace


def _in_this_thread(is_tracing):
    @functools.wraps(is_tracing)
    def is_tracing_in_this_thread():
        return getattr(_tracing, "depth", 0) > 0 and is_tracing()

    return is_tracing_in_this_thread
