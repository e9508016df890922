"""The one list of torch_xla's and Lightning's private names that tpunb uses
(``tpunb/upstream/__init__.py``): complete, present in both supported pairs, and checked before a
launch forks."""

import re
from pathlib import Path

import pytest

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


def test_the_installed_pair_has_every_name_on_the_list():
    assert [upstream.missing(names) for names in EVERY_LIST] == [[], [], []]


def _never_run(rank):
    raise AssertionError("no rank may start")


def test_a_launch_without_a_name_it_needs_is_refused_before_any_fork(cores8, monkeypatch):
    import torch_xla

    # A torch_xla that renamed one (it is spelled "placecholder" in 2.8 and 2.9).
    monkeypatch.delattr(torch_xla._XLAC, "_is_placecholder")
    with pytest.raises(tpunb.TpunbError) as refused:
        tpunb.launch(_never_run)
    message = str(refused.value)
    assert "torch_xla._XLAC._is_placecholder" in message
    assert "tpunb supports torch_xla 2.8 and 2.9" in message


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
