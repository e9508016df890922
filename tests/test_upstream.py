"""The one list of torch_xla's and Lightning's private names that tpunb uses
(``tpunb/upstream/__init__.py``): complete, present in both supported pairs, and checked before a
launch forks."""

import re
from pathlib import Path

import pytest
import torch

import tpunb
from tpunb import upstream

SOURCE = Path(tpunb.__file__).parent
EVERY_LIST = (upstream.LAUNCH, upstream.LIGHTNING, upstream.SIMULATION)


def _listed():
    return {
        (module, name) for names in EVERY_LIST for module, found in names.items() for name in found
    }


def _used():
    """(module, name) of each private name the code reaches through its usual aliases, and
    the collective primitives it replaces by name."""
    aliases = {
        r"_XLAC\.(_\w+)": "torch_xla._XLAC",
        r"\bxm\.(_\w+)": "torch_xla.core.xla_model",
        r"\bxr\.(_[A-Z_]+)\b": "torch_xla.runtime",
        r"\bpjrt\.(\w+)": "torch_xla._internal.pjrt",
        r"\bbridge\.(\w+)": "torch_xla._dynamo.dynamo_bridge",
        r"\bc10d\.(_\w+)": "torch.distributed.distributed_c10d",
    }
    used = set()
    for path in SOURCE.rglob("*.py"):
        text = path.read_text()
        for pattern, module in aliases.items():
            # "pjrt.py", "dynamo_bridge.py": a file named in a docstring
            used |= {(module, name) for name in re.findall(pattern, text) if name != "py"}
    from tpunb.simulation import host_collectives
    from tpunb.upstream import registry

    primitives = set(registry.COLLECTIVE_PRIMITIVES) | set(host_collectives._PRIMITIVES)
    return used | {("torch_xla._XLAC", name) for name in primitives}


def test_every_private_name_the_code_uses_is_on_the_list():
    assert sorted(_used() - _listed()) == []


def test_every_private_name_read_through_getattr_is_on_the_list():
    # getattr(obj, "_name", default) reads an upstream object's private attribute too,
    # where a rename would silently give the default.
    own = {"__tpunb_patch__", "_rank", "_extraction"}  # tpunb's own attributes
    read = set()
    for path in SOURCE.rglob("*.py"):
        calls = r"getattr\((?:[^,()]|\([^()]*\))+, \"(_[a-z]\w*)\""
        read |= set(re.findall(calls, path.read_text()))
    listed = {name for _, name in _listed()}
    assert len(read) >= 4
    assert sorted(read - own - listed) == []


def test_the_installed_pair_has_every_name_on_the_list():
    assert [upstream.missing(names) for names in EVERY_LIST] == [[], [], []]


def test_every_replaced_torch_xla_callable_has_the_parameters_the_table_says():
    from tpunb.upstream import registry

    replaced = {
        f"{owner}.{name}"
        for patch in registry.PATCHES
        if patch.make is not None
        for owner in patch.owners
        if owner.startswith("torch_xla")
        for name in patch.attributes()
    }
    assert replaced == set(upstream.SIGNATURES)
    assert upstream.changed((registry.LAUNCH, registry.SIMULATION)) == []


def _steps(rank):
    import torch_xla

    total = torch.zeros(2, device=torch_xla.device())
    for _ in range(3):
        total = total + 1
        torch_xla.sync()
    return total.tolist()


def test_a_torch_xla_that_lacks_a_name_still_launches_without_the_watchers(cores8, monkeypatch):
    # A torch_xla that renamed one (it is spelled "placecholder" in 2.8 and 2.9), or changed
    # what a patch replaces: the launch runs, says so, and leaves out what needs them.
    import torch_xla
    import torch_xla.core.xla_model as xm

    monkeypatch.delattr(torch_xla._XLAC, "_is_placecholder")
    original = xm.add_step_closure

    def add_step_closure(closure, args=(), run_async=False, priority=0):  # a new parameter
        return original(closure, args, run_async)

    monkeypatch.setattr(xm, "add_step_closure", add_step_closure)
    with pytest.warns(tpunb.TpunbWarning) as warned:
        results = tpunb.launch(_steps, live=False)
    [message] = [str(w.message) for w in warned]
    assert "torch_xla._XLAC._is_placecholder" in message
    assert "torch_xla.core.xla_model.add_step_closure(closure, args, run_async, priority)" in (
        message
    )
    assert "(checked against 2.8 and 2.9)" not in message
    assert "checked against (2.8 and 2.9)" in message and "The launch runs" in message
    assert list(results) == [[3.0, 3.0]] * 8
    assert results.compiles.compiles == 0  # the compile watch left out
    assert all(len(steps) == 3 for steps in results.history.steps.values())  # steps kept


def test_simulate_with_a_changed_callable_is_refused_naming_it(monkeypatch):
    import torch_xla._internal.pjrt as pjrt

    monkeypatch.setattr(pjrt, "_run_thread_per_device", lambda local_rank, fn: None)
    with pytest.raises(tpunb.TpunbError, match=r"_run_thread_per_device\(local_rank, fn\)"):
        tpunb.simulate(cores=8)


def test_a_patch_is_made_once_stacks_on_another_and_keeps_the_upstream_function():
    import types

    from tpunb.upstream import patching

    def upstream(x):
        return x

    def adding(n):
        return lambda function: lambda x: function(x) + n

    owner = types.SimpleNamespace(f=upstream)
    first = patching.replace(owner, "f", "add one", adding(1))
    assert patching.replace(owner, "f", "add one", adding(100)) is first  # once
    patching.replace(owner, "f", "add ten", adding(10))  # on top of it
    assert owner.f(0) == 11 and list(patching.patches(owner.f)) == ["add ten", "add one"]
    assert patching.upstream(owner.f) is upstream


class _Base:
    def read(self):
        return "base"


class _Owner(_Base):
    def write(self):
        return "owner"


def _shouting(name, method):
    def shouted(self):
        return method(self).upper() + "!"

    return shouted


class _Twin(_Base):
    def write(self):
        return "twin"


def test_the_launchs_patches_are_put_back_as_they_were_also_on_an_error():
    from tpunb.upstream import patching

    owner, twin = _Owner(), _Twin()
    try:
        # Two owners, as torch_xla.sync is torch_xla's and torch_xla.torch_xla's: both patched
        # (only the first was, once).
        with patching.during((_Owner, _Twin), ["read", "write"], "shout", _shouting):
            assert (owner.read(), owner.write()) == ("BASE!", "OWNER!")
            assert (twin.read(), twin.write()) == ("BASE!", "OWNER!")  # the first owner's
            raise KeyError("the launch failed")
    except KeyError:
        pass
    assert (owner.read(), owner.write(), twin.write()) == ("base", "owner", "twin")
    assert "read" not in vars(_Owner) and "read" not in vars(_Twin)  # inherited again
    assert list(patching.patches(_Owner.write)) == list(patching.patches(_Twin.write)) == []


def test_every_patch_in_the_registry_has_its_maker_and_its_upstream_names():
    from tpunb.upstream import registry

    absent = []
    for patch in registry.PATCHES:
        if patch.make is not None and not callable(registry.resolve(patch.make)):
            absent.append(patch.make)
        for owner in patch.owners:
            found = [hasattr(registry.resolve(owner), name) for name in patch.attributes()]
            if not all(found):
                absent.append(f"{owner}: {patch.attributes()}")
    assert absent == []


def test_simulate_installs_each_of_the_simulations_patches_once():
    import torch_xla
    import torch_xla._internal.pjrt as pjrt
    import torch_xla.core.xla_model as xm

    from tpunb.upstream import patching, step_hooks

    def chains():
        return (
            list(patching.patches(xm.all_reduce)),
            list(patching.patches(torch_xla._XLAC._xla_collective_permute)),
            list(patching.patches(pjrt._run_thread_per_device)),
            len(step_hooks._hooks["after"]),
        )

    tpunb.simulate(cores=8)
    first = chains()
    assert first[:3] == (
        ["host_collectives"],
        ["permute_among_some", "host_collectives"],
        ["rank_process"],
    )
    tpunb.simulate(cores=4)
    assert chains() == first  # the same patches, the step hooks added once


def _upstream_names(tree):
    """The names a module binds to modules and classes it imports from outside tpunb."""
    import ast

    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            if module.startswith("tpunb") or getattr(node, "level", 0):
                continue
            names |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if not alias.name.startswith("tpunb")
            }
    return names


# Assignments that replace nothing: the command line a program run by ``python -m
# tpunb.simulate`` sees (as ``python -m`` sets it), and the rank Lightning's own strategies
# give ``rank_zero_only`` as they set up.
_NOT_PATCHES = {"sys.argv", "rank_zero_only.rank"}


def test_no_upstream_module_or_class_is_assigned_to_outside_the_registry():
    import ast

    found = []
    for path in SOURCE.rglob("*.py"):
        if path.name == "patching.py":  # the registry's mechanics
            continue
        tree = ast.parse(path.read_text())
        upstream_names = _upstream_names(tree)

        def root(node):
            while isinstance(node, ast.Attribute):
                node = node.value
            return node.id if isinstance(node, ast.Name) else None

        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for each in targets for t in getattr(each, "elts", [each])]
                targets = [t for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "setattr",
                "delattr",
            ):
                targets = node.args[:1]
            found += [
                f"{path.relative_to(SOURCE)}:{node.lineno}"
                for target in targets
                if root(target) in upstream_names and ast.unparse(target) not in _NOT_PATCHES
            ]
    assert found == []


def test_every_patch_the_code_names_is_in_the_registry():
    # Patch names are identifiers, checked as the registry is built; a name the code passes
    # to the registry that no patch has would fail only when that code runs: checked here.
    import ast

    from tpunb.upstream import registry

    named = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            function = getattr(node, "func", None)
            called = (  # registry.install(...), or install(...) inside the registry
                getattr(function, "attr", None)
                if getattr(getattr(function, "value", None), "id", None) == "registry"
                else getattr(function, "id", None)
                if path.name == "registry.py"
                else None
            )
            if (
                called in ("install", "during", "entries")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                named.add((path.name, node.args[0].value))
    assert len(named) >= 10
    assert sorted(name for name in named if name[1] not in registry.NAMES) == []
    with pytest.raises(ValueError, match="an identifier"):
        registry.Patch("os", ("fork",), "forks one at a time", None, registry.LAUNCH)


def test_the_lightning_range_is_checked_by_minor_version():
    from tpunb.upstream import versions

    supported = ["2.2.0", "2.6.6", "2.6.0rc1+local"]
    outside = ["2.1.3", "2.7.0", "3.0.0"]
    assert [versions.lightning_supported(v) for v in supported] == [True] * 3
    assert [versions.lightning_supported(v) for v in outside] == [False] * 3


def test_the_lightning_extra_installs_the_supported_range_only():
    # Lightning's source after 2.6 moves its XLA strategies into pytorch_lightning_enterprise.
    import tomllib

    from tpunb.upstream import versions

    low, high = versions.SUPPORTED_LIGHTNING
    major, minor = map(int, high.split("."))
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = project["project"]["optional-dependencies"]["lightning"]
    assert extra == [f"lightning>={low},<{major}.{minor + 1}"]
