"""In a rank, while a launch runs: where it reads device values, and whether a read cuts
the training step.

A read (``.item()``, ``.cpu()``, ``.tolist()``, ``.to("cpu")``, ``float()``/``int()``,
``bool()`` as in ``if t:``, ``print``/``repr``/f-strings) copies a value to the host. Of
a value the step has not computed yet, torch_xla must first run the pending graph up to
it (``_check_tensor_need_materialization`` answers that, and on simulated cores
``pending_on_a_tpu`` answers as a TPU would): the step's graph is cut there,
and its work is traced, compiled and run in two parts. Of a computed value (after a
sync, in ``xm.add_step_closure``) a read cuts nothing; it waits for the device where an
execution is still computing the value. The Tensor methods are wrapped for the launch;
each read that cuts or waits is given to the rank's recorder with the user's file and
line: the innermost frame outside torch and torch_xla (reads of tpunb's own, the
simulation's among them, are not the user's).

A sync that runs pending work is told apart too (``sync_ran_work``): where a loader's
batch has two of them, the step's work ran as two graphs, and the notebook's own sync
(``torch_xla.sync()``, ``xm.mark_step()``, ``xm.optimizer_step(..., barrier=True)``) is
the one to name."""

import contextlib
import os
import sys
import threading

from tpunb import program_lines
from tpunb.upstream import registry

# Method name -> how a learner writes the read.
READS = {
    "item": ".item()",
    "tolist": ".tolist()",
    "cpu": ".cpu()",
    "to": '.to("cpu")',
    "__bool__": "bool() or `if` on a tensor",
    "__float__": "float()",
    "__int__": "int()",
    "__index__": "a tensor used as an index or range()",
    "__repr__": "print() or repr()",
    "__format__": "an f-string or format()",
}
# The torch_xla functions through which a program syncs itself, as a learner writes them.
_SYNCS = {
    "sync": "torch_xla.sync()",
    "mark_step": "xm.mark_step()",
    "optimizer_step": "xm.optimizer_step(..., barrier=True)",
}
_INSTALLED = ("site-packages", "dist-packages")  # a library's frame, not the program's
_inside = threading.local()  # depth of wrapped reads in this thread: the outermost counts
_TPUNB = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_line(libraries):
    """(file, line) of the innermost frame outside torch and torch_xla; None where that is
    tpunb's own code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(libraries):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_TPUNB):
        return None
    return program_lines.cell_or_file(frame.f_code.co_filename), frame.f_lineno


def sync_ran_work():
    """For a sync about to run: None where nothing is pending on the device (it runs no
    graph); else ``(what, file, line)`` of the program's own sync call, or ``()`` where a
    loader or a library syncs (torch_xla's loader at each batch, Lightning)."""
    import torch_xla

    try:
        pending = torch_xla._XLAC._check_device_tensor_need_materialization(str(torch_xla.device()))
    except RuntimeError:
        # A graph that failed on the device (RESOURCE_EXHAUSTED: out of memory) leaves its
        # outputs with neither data nor a graph, which this check refuses with "Check
        # failed: false" (check_materialization_helper, torch_xla/csrc/
        # init_python_bindings.cpp). The sync goes on and raises the device's own error.
        return None
    if not any(pending):
        return None
    frame, entry = program_lines.program_frame(sys._getframe(1), program_lines.libraries())
    installed = frame is not None and any(p in frame.f_code.co_filename for p in _INSTALLED)
    if frame is None or entry not in _SYNCS or installed:
        return ()
    return _SYNCS[entry], program_lines.cell_or_file(frame.f_code.co_filename), frame.f_lineno


def _reads_to_host(torch, name, args, kwargs):
    if name != "to":
        return True
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str):
        return target.split(":")[0] == "cpu"
    return isinstance(target, torch.device) and target.type == "cpu"


def pending_on_a_tpu(tensor, pending):
    """For a read of ``tensor``: whether a TPU would still have it to compute, given whether
    torch_xla here has (``pending``). On a TPU, torch_xla's answer. Simulated cores answer
    as a TPU would (the registry's "reads_as_on_a_tpu"): the cut before each of their host
    collectives computes the step's pending work early."""
    return pending


def _kind(torch_xla, tensor):
    """ "cut": the value is not computed yet and other work is pending beside it (the
    sync computes that again: a read after a loop, of the only value pending, cuts
    nothing); "wait": an execution dispatched at a sync is computing it (its data a
    placeholder until then); None: it is there to copy."""
    try:
        here = torch_xla._XLAC._check_tensor_need_materialization([tensor])[0]
        if pending_on_a_tpu(tensor, here):
            device = str(tensor.device)
            others = sum(torch_xla._XLAC._check_device_tensor_need_materialization(device)) - here
            return "cut" if others else None
        # spelled so in torch_xla 2.8 and 2.9 (init_python_bindings.cpp)
        return "wait" if torch_xla._XLAC._is_placecholder(tensor) else None
    except RuntimeError:  # not an XLA tensor: a fake one of torch.compile's, printed
        return None


def watching(name, method, on_read, libraries):
    """The registry's maker: the Tensor method ``name`` calling ``on_read`` for a read that
    cuts or waits."""
    import torch
    import torch_xla

    def read(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo traces the method alone (no graph break)
            return method(self, *args, **kwargs)
        if (
            getattr(_inside, "depth", 0) == 0
            and self.device.type == "xla"
            and _reads_to_host(torch, name, args, kwargs)
        ):
            kind = _kind(torch_xla, self)  # most reads copy a value that is there: None
            where = _user_line(libraries) if kind is not None else None
            if where is not None:
                on_read(kind, READS[name], *where)
        _inside.depth = getattr(_inside, "depth", 0) + 1
        __tracebackhide__ = True  # a rank's traceback shows the program's read, not this
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.depth -= 1

    read.__name__ = read.__qualname__ = name
    read.__doc__ = method.__doc__
    return read


@contextlib.contextmanager
def watched(on_read):
    """For the duration: every read of a device value that cuts the step or waits for the
    device calls ``on_read(kind, what, file, line)`` in the reading thread (``kind``: "cut"
    or "wait", as ``_kind`` tells)."""
    with registry.during("launch_reads", on_read, program_lines.libraries(own=False)):
        yield
