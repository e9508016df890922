"""Work just before and just after torch_xla's step marker, with no frame of tpunb's on
the stack while the marker runs.

torch_xla's debug output (``PT_XLA_DEBUG_LEVEL``) names the cause of each compilation and
execution from the Python frames above the step marker: "user torch_xla.sync" only when
the innermost frame is torch_xla's own ``sync`` (``analyze_graph_execution_python_frame``
in https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/debug_util.cpp), and it
prints the frames from there up. A wrapper around ``torch_xla.sync`` or the marker would
be that frame, and the user's line would be pushed down the list.

So ``torch_xla.sync`` becomes torch_xla's own function (its code, its file and lines) run
with two names changed: the ``torch_xla`` and ``xm`` it makes its calls through. There,
the device lookup that opens a sync runs the ``before`` hooks, the master-ordinal check
right after the marker the ``dispatched`` hooks, and the token reset that closes the sync
(after the step closures) the ``after`` hooks. While the marker runs, the frames are
torch_xla's ``sync`` and its caller's, as on a TPU without tpunb.

That rebuild knows the body of torch_xla 2.8's and 2.9's ``sync``: it checks, before any
launch forks, that the body makes the three calls it hooks, once each and in that order.
A body that does not (another release) gets the hooks around the whole call instead: only
the debug output's naming of the calling frame is lost, never a step (``_around``).

Both wings use it: the launch ends its steps here (also on a TPU), the simulation
coordinates its ranks. Hooks are called with the name of the module that called
``torch_xla.sync`` (its dynamo bridge's syncs are inside a user's step).
"""

import dis
import functools
import sys
import threading
import types

_hooks = {"before": [], "dispatched": [], "after": []}
_callers = threading.local()  # .stack: the modules that called the syncs under way here


def add(before=None, dispatched=None, after=None):
    """Runs ``before(caller)`` just before every later step marker of ``torch_xla.sync``,
    ``dispatched(caller)`` just after it, and ``after(caller)`` once the sync has run its
    step closures, once the registry's "step_hooks" patch is in place (``registry.
    add_step_hooks`` puts it there first). Returns a handle for ``remove``."""
    handle = {"before": before, "dispatched": dispatched, "after": after}
    for kind, hook in handle.items():
        if hook is not None:
            _hooks[kind].append(hook)
    return handle


def remove(handle):
    for kind, hook in handle.items():
        if hook is not None:
            _hooks[kind].remove(hook)


def _stack():
    if not hasattr(_callers, "stack"):
        _callers.stack = []
    return _callers.stack


def _run(kind, caller):
    # As nested wrappers would: the hooks added last run first before the marker, last after.
    hooks = list(_hooks[kind])
    for hook in reversed(hooks) if kind == "before" else hooks:
        hook(caller)


# The calls of torch_xla's sync that the rebuilt one hooks, in the order its body makes them.
HOOKED_CALLS = ("_xla_get_default_device", "is_master_ordinal", "_set_all_reduce_token")


def knows(function):
    """Whether ``function``'s body makes the hooked calls, once each, in their order."""
    loads = dis.get_instructions(function.__code__)
    return tuple(i.argval for i in loads if i.argval in HOOKED_CALLS) == HOOKED_CALLS


def hooked(_, upstream):
    """The registry's maker: ``upstream`` rebuilt with the hooks, or wrapped if unknown."""
    if not knows(upstream):
        return _around(upstream)
    import torch_xla
    import torch_xla.torch_xla as module

    names = dict(module.__dict__)
    names["torch_xla"] = _TorchXla(torch_xla)
    names["xm"] = _XlaModel(module.xm)
    hooked = types.FunctionType(
        upstream.__code__, names, upstream.__name__, upstream.__defaults__, upstream.__closure__
    )
    hooked.__kwdefaults__ = upstream.__kwdefaults__
    hooked.__doc__ = upstream.__doc__
    hooked.__module__ = upstream.__module__
    hooked.__qualname__ = upstream.__qualname__
    return hooked


def _around(upstream):
    """The hooks around a ``sync`` whose body the rebuild does not know: before, then the
    whole sync (its step closures included), then ``dispatched`` and ``after``."""

    @functools.wraps(upstream)
    def sync(*args, **kwargs):
        __tracebackhide__ = True
        caller = sys._getframe(1).f_globals.get("__name__", "")
        _run("before", caller)
        upstream(*args, **kwargs)
        _run("dispatched", caller)
        _run("after", caller)

    return sync


class _TorchXla:
    """The ``torch_xla`` package as the hooked sync sees it: everything as it is, but its
    ``_XLAC``."""

    def __init__(self, package):
        self._package = package
        self._XLAC = _Runtime(package._XLAC)

    def __getattr__(self, name):
        return getattr(self._package, name)


class _Runtime:
    """torch_xla's C++ bindings as the hooked sync sees them: the default-device lookup
    that opens a sync runs the ``before`` hooks, the token reset that closes it the
    ``after`` hooks. Everything else is looked up at call time (the simulation may have
    replaced a binding)."""

    def __init__(self, bindings):
        self._bindings = bindings

    def __getattr__(self, name):
        return getattr(self._bindings, name)

    def _xla_get_default_device(self):
        __tracebackhide__ = True  # a rank's traceback shows torch_xla.sync(), not this
        caller = sys._getframe(2).f_globals.get("__name__", "")  # sync's caller
        _stack().append(caller)
        _run("before", caller)
        return self._bindings._xla_get_default_device()

    def _set_all_reduce_token(self, device, token):
        self._bindings._set_all_reduce_token(device, token)
        stack = _stack()
        _run("after", stack.pop() if stack else "")


class _XlaModel:
    """``torch_xla.core.xla_model`` as the hooked sync sees it: the master-ordinal check
    that follows the marker runs the ``dispatched`` hooks first."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def is_master_ordinal(self, *args, **kwargs):
        stack = _stack()
        _run("dispatched", stack[-1] if stack else "")
        return self._module.is_master_ordinal(*args, **kwargs)
