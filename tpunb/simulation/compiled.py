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
   ... 'DynamoExtractCompiledGraph', None``). And the backend extracts a graph the first
   time it runs (``fwd`` in torch/_dynamo/backends/torchxla.py checks, then extracts): two
   ranks running it first at once both extract it, from a graph the first one has already
   changed ("replace_with already has .meta keys"). And the extraction builds torch.fx
   graphs, whose new nodes take the metadata that torch.fx keeps per process for the
   compilation under way (``torch.fx.traceback``): a rank extracting while another compiles
   gets that rank's metadata, with the same error. Here the ranks extract under dynamo's
   ``compile_lock``, one at a time and while no rank compiles, and a graph once: the others
   get what the first extracted.

3. AOT autograd's backward compilation. dynamo compiles one frame at a time (its
   ``compile_lock``), but the backward of a compiled model is compiled lazily, at its first
   backward pass, outside that lock (``_backward_impl`` in
   torch/_functorch/_aot_autograd/runtime_wrappers.py), in the process-wide compile metrics
   and on the graph the ranks share. Ranks that run their first backward at once fail with
   "Metric(s) {'is_forward'} already set" or "replace_with already has .meta keys". Here
   that compilation holds dynamo's ``compile_lock``, as every other compilation does: the
   ranks compile it one after another (each its own, as each TPU process would).

Collectives inside a compiled function run between the graphs compiled before and after
them (collectives.py), as their own graph.
"""

import functools
import threading

_tracing = threading.local()


# The registry's makers (its "threads" entries).
def one_at_a_time(_, extract):
    @functools.wraps(extract)
    def extract_compiled_graph(model, *args, **kwargs):
        from torch._dynamo.convert_frame import compile_lock

        with compile_lock:
            extracted = getattr(model, "_extracted_by_tpunb", None)
            if extracted is None:
                extracted = extract(model, *args, **kwargs)
                model._extracted_by_tpunb = extracted
            return extracted

    return extract_compiled_graph


def marking_this_thread(_, trace):
    @functools.wraps(trace)
    def marked_trace(*args, **kwargs):
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            return trace(*args, **kwargs)
        finally:
            _tracing.depth -= 1

    return marked_trace


def in_this_thread(_, is_tracing):
    @functools.wraps(is_tracing)
    def is_tracing_in_this_thread():
        return getattr(_tracing, "depth", 0) > 0 and is_tracing()

    return is_tracing_in_this_thread


def holding_the_compile_lock(_, get_metrics_context):
    """``get_metrics_context`` for the lazy backward compilation (point 3): its context
    holds dynamo's compile lock while it is entered."""
    from torch._dynamo.convert_frame import compile_lock

    @functools.wraps(get_metrics_context)
    def metrics_context_holding_the_compile_lock():
        return _Holding(compile_lock, get_metrics_context())

    return metrics_context_holding_the_compile_lock


class _Holding:
    def __init__(self, lock, context):
        self.lock = lock
        self.context = context

    def __enter__(self):
        self.lock.acquire()
        try:
            return self.context.__enter__()
        except BaseException:
            self.lock.release()
            raise

    def __exit__(self, *exc_info):
        try:
            return self.context.__exit__(*exc_info)
        finally:
            self.lock.release()
