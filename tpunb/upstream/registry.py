"""Every attribute of torch_xla, torch, Lightning or the standard library that tpunb
replaces, in one table (``PATCHES``): its owner, the names, the patch's name, the function
that makes the replacement, where it holds (``scope``) and whether it is put back when the
launch ends (``undone``). Installing, putting back and "is it in place?" go through here
alone (the mechanics: ``patching.py``); the simulation's entries are installed together
(``install_simulation``); the private names the version check reads
(``upstream/__init__.py``) are generated from the table.

A maker is named "module:function", imported only when the patch is installed, and called
``make(name, current, *context)``: the attribute's name, what is there now, and what the
installing code passes (a launch's recorder, a rank's numbers).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tpunb.upstream import patching, step_hooks

LAUNCH = "launch"  # every launch, on a TPU too
SIMULATION = "simulation"  # tpunb.simulate: a process a core, never on a TPU

# The primitives every Python collective (xm.*, torch.distributed's XLA backend,
# torch_xla.core.functions, SyncBatchNorm) reaches, which the simulation replaces.
COLLECTIVE_PRIMITIVES = (
    "_xla_all_reduce",
    "_xla_all_reduce_inplace",
    "_xla_all_gather",
    "_xla_all_gather_out",
    "_xla_all_gather_coalesced",
    "_xla_all_gather_coalesced_out",
    "_xla_reduce_scatter",
    "_xla_reduce_scatter_out",
    "_xla_reduce_scatter_coalesced",
    "_xla_reduce_scatter_coalesced_out",
    "_xla_all_to_all",
    "_xla_collective_permute",
)


@dataclass(frozen=True)
class Patch:
    """One replacement: ``names`` of ``owner`` (a module, or a class inside one, dotted;
    several owners that hold the same function: a tuple) made by ``make``."""

    owner: str | tuple[str, ...]
    names: tuple[str, ...] | str  # or "module:attribute" holding them
    name: str
    make: str | None  # "module:function"; None: a value the installing code gives
    scope: str
    undone: bool = False  # in place only inside ``during``

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a patch's name is an identifier: {self.name!r}")

    @property
    def owners(self) -> tuple[str, ...]:
        return self.owner if isinstance(self.owner, tuple) else (self.owner,)

    def attributes(self) -> tuple[str, ...]:
        return tuple(resolve(self.names)) if isinstance(self.names, str) else self.names


_XM = "torch_xla.core.xla_model"
_XLAC = "torch_xla._XLAC"
_PJRT = "torch_xla._internal.pjrt"
_BRIDGE = "torch_xla._dynamo.dynamo_bridge"

# In the order they are installed: a later patch of an attribute wraps an earlier one.
PATCHES = (
    # Every launch, on a TPU too.
    Patch(("torch_xla", "torch_xla.torch_xla"), ("sync",), "step_hooks",
          "tpunb.upstream.step_hooks:hooked", LAUNCH),
    Patch("torch_xla.distributed.parallel_loader.PerDeviceLoader", ("next",), "launch_batches",
          "tpunb.launcher.hooks:recorded_batches", LAUNCH, undone=True),
    Patch(_XM, ("add_step_closure", "xla_rendezvous"), "launch_excused_reads",
          "tpunb.launcher.hooks:excused", LAUNCH, undone=True),
    Patch("torch.Tensor", "tpunb.launcher.reads:READS", "launch_reads",
          "tpunb.launcher.reads:watching", LAUNCH, undone=True),
    Patch(_XM, "tpunb.watch.collective_calls:RECORDED", "collective_ledger",
          "tpunb.watch.collective_calls:recording", LAUNCH, undone=True),
    Patch("multiprocessing.process", ("_children",), "launch_started_processes",
          "tpunb.launcher.processes:recording", LAUNCH, undone=True),
    # The simulation.
    Patch("os", ("putenv",), "runtime_on_cpu",
          "tpunb.simulation.tpu_host:putenv_keeping_cpu", SIMULATION),
    Patch("torch_xla._internal.tpu", ("num_available_chips",), "simulated_chips",
          "tpunb.simulation.tpu_host:simulated_chips", SIMULATION),
    Patch(_XM, ("xla_device_hw",), "tpu_hardware",
          "tpunb.simulation.tpu_host:tpu_hardware", SIMULATION),
    Patch("torch_xla.runtime", ("initialize_cache",), "cache_never_loads",
          "tpunb.simulation.tpu_host:cache_warning", SIMULATION),
    Patch("multiprocessing.spawn", ("get_command_line",), "spawned_children_simulate",
          "tpunb.simulation.spawned:command_line_simulating", SIMULATION),
    Patch("multiprocessing.resource_tracker", ("register",), "untracked_shared_memory",
          "tpunb.simulation.host_exchange:register_nothing", SIMULATION, undone=True),
    Patch(_BRIDGE, ("extract_compiled_graph_helper",), "collectives_between_graphs",
          "tpunb.simulation.functional_collectives:extracting", SIMULATION),
    Patch(f"{_BRIDGE}.UnsupportedNodesCollector", ("run_node",), "collectives_between_graphs",
          "tpunb.simulation.functional_collectives:leaving_collectives_out", SIMULATION),
    Patch(f"{_BRIDGE}.InputCollector", ("run_node",), "collectives_between_graphs",
          "tpunb.simulation.functional_collectives:leaving_collectives_out", SIMULATION),
    Patch(_BRIDGE, ("extract_graph_helper",), "copy_only_parts",
          "tpunb.simulation.functional_collectives:copies_compiled", SIMULATION),
    Patch(_XLAC, ("_get_graph_hash",), "copy_only_parts",
          "tpunb.simulation.functional_collectives:hash_of_copies", SIMULATION),
    Patch(_PJRT, ("run_multiprocess",), "meeting_around_spawn",
          "tpunb.simulation.rank_processes:run_in_meeting", SIMULATION),
    Patch(_PJRT, ("_run_thread_per_device",), "rank_process",
          "tpunb.simulation.rank_processes:run_as_rank_process", SIMULATION),
    Patch("torch_xla.runtime", ("process_index", "process_count", "global_device_count"),
          "v5e_process_answers", "tpunb.simulation.rank_processes:v5e_answer", SIMULATION),
    Patch("torch_xla.runtime", ("global_runtime_device_count",), "v5e_process_answers",
          "tpunb.simulation.rank_processes:global_device_count", SIMULATION),
    Patch("torch_xla.runtime", ("_WORLD_SIZE", "_ORDINAL"), "v5e_world_and_ordinal", None,
          SIMULATION),
    Patch(_XLAC, COLLECTIVE_PRIMITIVES, "host_collectives",
          "tpunb.simulation.host_collectives:host_primitive", SIMULATION),
    Patch(_XM, ("all_reduce",), "host_collectives",
          "tpunb.simulation.host_collectives:host_all_reduce", SIMULATION),
    # A read of a value the cut before a host collective computed early: pending on a TPU.
    Patch("tpunb.launcher.reads", ("pending_on_a_tpu",), "reads_as_on_a_tpu",
          "tpunb.simulation.host_collectives:pending_on_a_tpu", SIMULATION),
    Patch(_XLAC, ("_xla_tensors_from_aten",), "reads_as_on_a_tpu",
          "tpunb.simulation.host_collectives:copies_recorded", SIMULATION),
    Patch("sys", ("excepthook",), "torchrun_error_kept",
          "tpunb.simulation.torchrun:excepthook_keeping_error", SIMULATION),
    # xm.send and xm.recv, and the permute among some of the ranks (torch.distributed's send
    # and recv) around the host collectives' permute.
    Patch(_XM, ("send", "recv"), "host_send_recv",
          "tpunb.simulation.point_to_point:send_recv_through_host", SIMULATION),
    Patch(_XLAC, ("_xla_collective_permute",), "permute_among_some",
          "tpunb.simulation.point_to_point:permute_through_host", SIMULATION),
    # The report of python -m tpunb.simulate and pytest --tpunb-simulate (pitfalls.py):
    # where each DataLoader was built, and the first batch of each pass over one.
    Patch("torch.utils.data.DataLoader", ("__init__",), "loaders_read_alike",
          "tpunb.simulation.pitfalls:built_noted", SIMULATION),
    Patch("torch.utils.data.dataloader._BaseDataLoaderIter", ("__init__", "__next__"),
          "loaders_read_alike", "tpunb.simulation.pitfalls:passes_noted", SIMULATION),
)  # fmt: skip

# The simulation's own work at each sync (``step_hooks``), "module:attribute" of keyword
# arguments.
SIMULATION_STEP_HOOKS = "tpunb.simulation.host_collectives:STEP_HOOKS"
# Installed by the code that needs them, at that moment, instead of with the simulation.
_ON_DEMAND = ("v5e_world_and_ordinal", "torchrun_error_kept", "loaders_read_alike")


NAMES = frozenset(patch.name for patch in PATCHES)
assert set(_ON_DEMAND) <= NAMES, _ON_DEMAND


def entries(name: str) -> tuple[Patch, ...]:
    """The table's entries of the patch called ``name`` (one of ``NAMES``, which
    tests/test_upstream.py checks every name in the code against)."""
    found = tuple(patch for patch in PATCHES if patch.name == name)
    if not found:
        raise KeyError(f"no patch called {name!r}")
    return found


def install(name: str, *context: Any) -> None:
    """Puts the patch called ``name`` in place, unless it is there already, made with
    ``context``; a value patch (``make`` None) takes its values from ``context``, in the
    order of its names."""
    for patch in entries(name):
        owners = tuple(resolve(owner) for owner in patch.owners)
        for index, attribute in enumerate(patch.attributes()):
            if patch.make is None:
                patching.assign(owners, attribute, context[index])
                continue
            make = resolve(patch.make)
            patching.replace(
                owners,
                attribute,
                patch.name,
                lambda current, a=attribute, make=make: make(a, current, *context),
            )


@contextlib.contextmanager
def during(name: str, *context: Any) -> Iterator[None]:
    """For the duration: the patch called ``name`` (``undone`` in the table) in place, made
    with ``context``; afterwards what was there before."""
    with contextlib.ExitStack() as stack:
        for patch in entries(name):
            assert patch.undone, f"{name!r} stays in place: install it"
            make = resolve(patch.make)
            stack.enter_context(
                patching.during(
                    tuple(resolve(owner) for owner in patch.owners),
                    patch.attributes(),
                    patch.name,
                    lambda attribute, current, make=make: make(attribute, current, *context),
                )
            )
        yield


def active(name: str) -> bool:
    """Whether the patch called ``name`` is in place now."""
    return all(_installed(patch) for patch in entries(name))


def install_simulation() -> None:
    """The simulation's patches in place (each once, however often ``simulate`` is called),
    and its work at each sync."""
    wanted = [
        patch
        for patch in PATCHES
        if patch.scope == SIMULATION and not patch.undone and patch.name not in _ON_DEMAND
    ]
    if all(_installed(patch) for patch in wanted):
        return
    for name in dict.fromkeys(patch.name for patch in wanted):
        install(name)
    add_step_hooks(**resolve(SIMULATION_STEP_HOOKS))


def _installed(patch: Patch) -> bool:
    """Whether ``patch`` is in place in every owner imported now."""
    return all(
        patch.name in patching.patches(getattr(owner, attribute))
        for owner, attribute in _slots([patch])
    )


def add_step_hooks(**hooks: Any) -> dict:
    """``step_hooks.add(**hooks)``, with ``torch_xla.sync`` hooked first (on a TPU too)."""
    install("step_hooks")
    return step_hooks.add(**hooks)


def private_names(scopes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Module (or class) -> the private names the patches of ``scopes`` replace: a name or
    an owner with a part that starts with "_" (torch_xla's ``_internal``, its ``_XLAC``),
    torch's and the standard library's included."""
    names: dict[str, tuple[str, ...]] = {}
    for patch in PATCHES:
        if patch.scope not in scopes:
            continue
        for owner in patch.owners:
            private = any(part.startswith("_") for part in owner.split("."))
            found = [
                name
                for name in (patch.names if isinstance(patch.names, tuple) else ())
                if private or name.startswith("_")
            ]
            if found:
                names[owner] = tuple(dict.fromkeys((*names.get(owner, ()), *found)))
    return names


def _slots(patches):
    """(owner, attribute) of each replacement ``patches`` make."""
    return [
        (resolve(owner), attribute)
        for patch in patches
        for owner in patch.owners
        for attribute in patch.attributes()
    ]


def resolve(dotted: str) -> Any:
    """The object "module:attribute" or "package.module.Class" names, imported; an
    ``ImportError`` or ``AttributeError`` if there is none."""
    if ":" in dotted:
        module, attribute = dotted.split(":")
        return getattr(importlib.import_module(module), attribute)
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            owner = getattr(owner, part)
        return owner
    raise ImportError(dotted)
