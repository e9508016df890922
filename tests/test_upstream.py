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
    from tpunb.simulation import collectives, host_collectives

    primitives = set(collectives.COLLECTIVE_PRIMITIVES) | set(host_collectives._PRIMITIVES)
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
    patching.replace(owner, "f", "add ten", adding(20), renew=True)  # made again
    assert owner.f(0) == 21 and list(patching.patches(owner.f)) == ["add ten", "add one"]


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


def test_the_launchs_patches_are_put_back_as_they_were_also_on_an_error():
    from tpunb.upstream import patching

    owner = _Owner()
    try:
        with patching.during(_Owner, ["read", "write"], "shout", _shouting):
            assert (owner.read(), owner.write()) == ("BASE!", "OWNER!")
            raise KeyError("the launch failed")
    except KeyError:
        pass
    assert (owner.read(), owner.write()) == ("base", "owner")
    assert "read" not in vars(_Owner)  # inherited again, not copied down
    assert list(patching.patches(_Owner.write)) == []
