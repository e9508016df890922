"""``tpunb/py.typed`` tells type checkers the package is typed: every public name is
annotated, and a user's typed code that calls it as documented checks clean."""

import inspect
import subprocess
import sys
import types

import pytest
from conftest import ROOT

pytestmark = pytest.mark.pair("colab", reason="the same annotations on both pairs: checked once")


def _public_callables():
    """(name, function) of tpunb's public API: the names in ``tpunb.__all__`` (and the
    public functions of its public modules), ``tpunb.lightning``'s, and their classes'
    public methods and properties."""
    import tpunb.lightning

    named = [(name, getattr(tpunb, name)) for name in tpunb.__all__]
    named += [
        (f"lightning.{name}", getattr(tpunb.lightning, name)) for name in tpunb.lightning.__all__
    ]
    for name, obj in named:
        if isinstance(obj, types.ModuleType):
            for inner, function in vars(obj).items():
                if inspect.isfunction(function) and not inner.startswith("_"):
                    if function.__module__ == obj.__name__:
                        yield f"{name}.{inner}", function
        elif inspect.isclass(obj):
            for inner, member in vars(obj).items():
                if inner.startswith("_") and inner != "__init__":
                    continue
                function = member.fget if isinstance(member, property) else member
                function = getattr(function, "__func__", function)  # classmethods
                if inspect.isfunction(function) and function.__module__.startswith("tpunb"):
                    yield f"{name}.{inner}", function
        elif inspect.isfunction(obj):
            yield name, obj


def test_every_public_function_and_method_is_annotated():
    missing = []
    for name, function in _public_callables():
        signature = inspect.signature(function)
        for parameter in list(signature.parameters.values())[:]:
            if parameter.name not in ("self", "cls") and parameter.annotation is parameter.empty:
                missing.append(f"{name}({parameter.name})")
        if signature.return_annotation is signature.empty:
            missing.append(f"{name} -> ?")
    assert missing == []


def test_every_public_function_says_its_arguments_and_what_it_returns():
    missing = []
    for name, function in _public_callables():
        if "." in function.__qualname__:  # a method: its class's docstring says what it is
            continue
        signature = inspect.signature(function)
        doc = inspect.getdoc(function) or ""
        if signature.parameters and "Args:" not in doc:
            missing.append(f"{name}: Args")
        if signature.return_annotation not in (None, "None") and "Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert missing == []


def test_a_users_typed_code_checks_clean_against_the_api():
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            str(ROOT / "tests" / "typed_api.py"),
        ],  # pyproject's settings
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
