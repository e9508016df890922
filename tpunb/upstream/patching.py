"""How a patch of ``registry.py`` replaces an upstream attribute: once per patch, with what
it replaced kept on the replacement, so that installing again leaves the patch in place,
patches stack (the simulation's point-to-point sends wrap a layout's collectives), and
code that must reach the upstream function finds it. Only ``registry.py`` calls these."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_PATCH = "__tpunb_patch__"  # on a replacement: (the patch's name, what it replaced)
_INHERITED = object()  # an attribute the owner only inherits (torch.Tensor's C methods)


def replace(owners: Any, name: str, patch: str, make: Callable[[Any], Any]) -> Any:
    """Sets attribute ``name`` of ``owners`` (an object, or a tuple of objects that hold the
    same function under that name) to ``make(current)``, unless the patch called ``patch``
    is already among the replacements there. Returns what is in place."""
    owners = owners if isinstance(owners, tuple) else (owners,)
    current = getattr(owners[0], name)
    if patch in patches(current):
        return current
    replacement = make(current)
    setattr(replacement, _PATCH, (patch, current))
    assign(owners, name, replacement)
    return replacement


def assign(owners: tuple[Any, ...], name: str, value: Any) -> None:
    """Sets attribute ``name`` of each of ``owners`` to ``value``: a value that cannot say
    which patch it is (a number), or what a patch replaced, put back."""
    for owner in owners:
        setattr(owner, name, value)


@contextlib.contextmanager
def during(
    owners: tuple[Any, ...], names: Iterable[str], patch: str, make: Callable[[str, Any], Any]
) -> Iterator[None]:
    """For the duration: each of ``names`` of each of ``owners`` replaced by ``make(name,
    current)``, as ``replace`` does; afterwards what was there before, an inherited
    attribute inherited again. The launch's patches, in place while a launch runs."""
    names = tuple(names)
    saved = {(owner, name): vars(owner).get(name, _INHERITED) for owner in owners for name in names}
    try:
        for name in names:
            replace(owners, name, patch, lambda current, name=name: make(name, current))
        yield
    finally:
        for (owner, name), value in saved.items():
            if value is _INHERITED:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def patches(value: Any) -> Iterator[str]:
    """The names of tpunb's patches that ``value`` is, outermost first."""
    while (marker := getattr(value, _PATCH, None)) is not None:
        yield marker[0]
        value = marker[1]


def upstream(value: Any) -> Any:
    """What ``value`` replaced, through all of tpunb's patches: the upstream function."""
    while (marker := getattr(value, _PATCH, None)) is not None:
        value = marker[1]
    return value
