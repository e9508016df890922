"""A collective call in words, for the launch's ledger of each rank's calls and the
simulation's check that the ranks' calls match: what it is (its name, its tensors' shapes
and dtypes, its other arguments) and where the program made it (its file and line, and the
torch_xla function it called there, e.g. ``xm.save``)."""

import sys


def describe(name, args, kwargs, shown=None):
    """``name(float32[4, 2], 'sum', groups=[[0, 1]])``: its tensors' dtypes and shapes and
    its other arguments; of a list of tensors the first ``shown`` (all if None)."""
    parts = [_value(arg, shown) for arg in args]
    parts += [f"{key}={_value(value, shown)}" for key, value in sorted(kwargs.items())]
    return f"{name.lstrip('_').replace('xla_', '', 1)}({', '.join(parts)})"


def among_some(pairs, world_size):
    """Whether a ``collective_permute`` with ``pairs`` leaves out some of the ``world_size``
    ranks: then only the ranks its pairs name make the call, each pair its own (what
    torch.distributed's ``send`` and ``recv`` lower to on the XLA backend)."""
    return {rank for pair in pairs for rank in pair} != set(range(world_size))


def key(name, args, kwargs):
    """What tells calls apart, to compare between forked ranks (one hash seed, one address
    for each dtype): the name, every tensor's dtype and shape, the other arguments."""
    return hash((name, _key(args), _key(sorted(kwargs.items()))))


def _key(value):
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.shape)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _value(value, shown=None):
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        values = list(value)
        if shown is not None and len(values) > shown:
            first = ", ".join(_value(v) for v in values[:shown])
            return f"{len(values)} tensors: [{first}, ...]"
        return "[" + ", ".join(_value(v) for v in values) + "]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return repr(list(value))
    return type(value).__name__
