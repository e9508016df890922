"""Every attribute of torch_xla, torch, Lightning or the standard library that tpunb
replaces, in one table (``PATCHES``): its owner, the names, the patch's name, the function
that makes the replacement, where it holds (``scope``) and whether it is put back when the
launch ends (``undone``). Installing, putting back and "is it in place?" go through here
alone (the mechanics: ``patching.py``); each simulation layout is a named set of entries
(``use_layout``), so no replacement asks at run time which layout it serves; the private
names the version check reads (``upstream/__init__.py``) are generated from the table.

A maker is named "module:function", imported only when the patch is installed, and called
``make(name, current, *context)``: the attribute's name, what is there now, and what the
installing code passes (a launch's recorder, a rank's numbers).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tpunb.upstream import patching, step_hooks

LAUNCH = "launch"  # every launch, on a TPU too
SIMULATION = "simulation"  # tpunb.simulate, in either layout
PROCESSES = "processes"  # the simulation's process layout (a process a core)
THREADS = "threads"  # the simulation's thread layout (a thread a core)

# The primitives every Python collective (xm.*, torch.distributed's XLA backend,
# torch_xla.core.functions, SyncBatchNorm) reaches, which each layout replaces.
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
    when_imported: bool = False  # installed only in an owner already imported (Lightning)
    optional: bool = False  # a name only some supported versions have

    @property
    def owners(self) -> tuple[str, ...]:
        return self.owner if isinstance(self.owner, tuple) else (self.owner,)

    def attributes(self) -> tuple[str, ...]:
        return tuple(resolve(self.names)) if isinstance(self.names, str) else self.names


_XM = "torch_xla.core.xla_model"
_XLAC = "torch_xla._XLAC"
_PJRT = "torch_xla._internal.pjrt"
_BRIDGE = "torch_xla._dynamo.dynamo_bridge"
_SYMBOLIC_TRACE = "torch.fx._symbolic_trace"
_LAUNCHERS = (
    "lightning.pytorch.strategies.launchers.xla._XLALauncher",
    "pytorch_lightning.strategies.launchers.xla._XLALauncher",
)

# In the order they are installed: a later patch of an attribute wraps an earlier one.
PATCHES = (
    # Every launch, on a TPU too.
    Patch(("torch_xla", "torch_xla.torch_xla"), ("sync",), "step hooks",
          "tpunb.upstream.step_hooks:hooked", LAUNCH),
    Patch(_PJRT, ("initialize_multiprocess",), "shared process",
          "tpunb.launcher.shared_process:then_prepare", LAUNCH),
    Patch("os", ("fork",), "forks one at a time",
          "tpunb.launcher.shared_process:one_at_a_time", LAUNCH),
    Patch("torch_xla.distributed.parallel_loader.PerDeviceLoader", ("next",), "launch: batches",
          "tpunb.launcher.hooks:recorded_batches", LAUNCH, undone=True),
    Patch(_XM, ("add_step_closure", "xla_rendezvous"), "launch: excused reads",
          "tpunb.launcher.hooks:excused", LAUNCH, undone=True),
    Patch("torch.Tensor", "tpunb.launcher.reads:READS", "launch: reads",
          "tpunb.launcher.reads:watching", LAUNCH, undone=True),
    Patch(_XM, "tpunb.launcher.ledger:RECORDED", "launch: the ledger",
          "tpunb.launcher.ledger:recording", LAUNCH, undone=True),
    Patch("multiprocessing.process", ("_children",), "launch: started processes",
          "tpunb.launcher.processes:recording", LAUNCH, undone=True),
    # The simulation, in either layout.
    Patch("os", ("putenv",), "runtime on the cpu",
          "tpunb.simulation.tpu_answers:runtime_on_the_cpu", SIMULATION),
    Patch("torch_xla._internal.tpu", ("num_available_chips",), "simulated chips",
          "tpunb.simulation.tpu_answers:simulated_chips", SIMULATION),
    Patch(_XM, ("xla_device_hw",), "a TPU", "tpunb.simulation.tpu_answers:as_tpu", SIMULATION),
    Patch("multiprocessing.spawn", ("get_command_line",), "simulating first",
          "tpunb.simulation.spawned:simulating_first", SIMULATION),
    Patch("multiprocessing.resource_tracker", ("register",), "untracked",
          "tpunb.simulation.host_exchange:registering_nothing", SIMULATION, undone=True),
    Patch(_BRIDGE, ("extract_compiled_graph_helper",), "collectives between",
          "tpunb.simulation.functional_collectives:extracting", SIMULATION),
    Patch(f"{_BRIDGE}.UnsupportedNodesCollector", ("run_node",), "collectives between",
          "tpunb.simulation.functional_collectives:leaving_collectives_out", SIMULATION),
    Patch(f"{_BRIDGE}.InputCollector", ("run_node",), "collectives between",
          "tpunb.simulation.functional_collectives:leaving_collectives_out", SIMULATION),
    Patch(_BRIDGE, ("extract_graph_helper",), "parts that copy",
          "tpunb.simulation.functional_collectives:copies_compiled", SIMULATION),
    Patch(_XLAC, ("_get_graph_hash",), "parts that copy",
          "tpunb.simulation.functional_collectives:hash_of_copies", SIMULATION),
    *(Patch(owner, ("_collect_rank_zero_results",), "trained weights back",
            "tpunb.simulation.lightning:collecting_the_trained_weights", SIMULATION,
            when_imported=True) for owner in _LAUNCHERS),
    # The process layout.
    Patch(_PJRT, ("run_multiprocess",), "a meeting around",
          "tpunb.simulation.rank_processes:meeting_around", PROCESSES),
    Patch(_PJRT, ("_run_thread_per_device",), "a rank process",
          "tpunb.simulation.rank_processes:as_a_rank_process", PROCESSES),
    Patch("torch_xla.runtime", ("process_index", "process_count", "global_device_count"),
          "as on a v5e", "tpunb.simulation.rank_processes:as_on_a_v5e", PROCESSES),
    Patch("torch_xla.runtime", ("global_runtime_device_count",), "as on a v5e",
          "tpunb.simulation.rank_processes:as_global_device_count", PROCESSES),
    Patch("torch_xla.runtime", ("_WORLD_SIZE", "_ORDINAL"), "a v5e process's place", None,
          PROCESSES),
    Patch(_XLAC, COLLECTIVE_PRIMITIVES, "on the host",
          "tpunb.simulation.host_collectives:in_ranks", PROCESSES),
    Patch(_XM, ("all_reduce",), "on the host",
          "tpunb.simulation.host_collectives:all_reduce_one_tensor_too_of", PROCESSES),
    Patch("sys", ("excepthook",), "the rank's error kept",
          "tpunb.simulation.torchrun:keeping_the_error", PROCESSES),
    # The thread layout.
    Patch(_XLAC, COLLECTIVE_PRIMITIVES, "own graph", "tpunb.simulation.collectives:own_graph",
          THREADS),
    Patch(_XM, ("all_reduce",), "own graph", "tpunb.simulation.collectives:own_graph", THREADS),
    Patch(_BRIDGE, ("extract_compiled_graph",), "one extraction",
          "tpunb.simulation.compiled:one_at_a_time", THREADS),
    Patch("torch._functorch._aot_autograd.runtime_wrappers", ("get_metrics_context",),
          "holding the compile lock", "tpunb.simulation.compiled:holding_the_compile_lock",
          THREADS),
    Patch(f"{_SYMBOLIC_TRACE}.Tracer", ("trace",), "tracing in this thread",
          "tpunb.simulation.compiled:marking_this_thread", THREADS),
    # torch 2.9's dynamo asks is_fx_symbolic_tracing, torch 2.8's is_fx_tracing.
    Patch(_SYMBOLIC_TRACE, ("is_fx_tracing", "is_fx_symbolic_tracing"),
          "tracing in this thread", "tpunb.simulation.compiled:in_this_thread", THREADS,
          optional=True),
    Patch(("torch", "torch.random"), ("manual_seed",), "seeds alone",
          "tpunb.simulation.random_state:seeding_alone", THREADS),
    Patch(_PJRT, ("_run_thread_per_device",), "rank threads",
          "tpunb.simulation.rank_threads:telling_the_collectives", THREADS),
    Patch("torch.distributed.distributed_c10d", ("_world",), "a world for each rank",
          "tpunb.simulation.process_groups:world_of_each_rank", THREADS),
    # The simulation again: xm.send and xm.recv, and the permute among some of the ranks
    # (torch.distributed's send and recv) around either layout's.
    Patch(_XM, ("send", "recv"), "host memory", "tpunb.simulation.point_to_point:through_host",
          SIMULATION),
    Patch(_XLAC, ("_xla_collective_permute",), "among some",
          "tpunb.simulation.point_to_point:among_some_of", SIMULATION),
)  # fmt: skip

# What each layout installs, besides the patches of the simulation: its set of entries,
# and its own work at each sync (``step_hooks``), "module:attribute" of keyword arguments.
LAYOUTS = {
    PROCESSES: "tpunb.simulation.host_collectives:STEP_HOOKS",
    THREADS: "tpunb.simulation.collectives:STEP_HOOKS",
}
# Installed by the code that needs them, at that moment, instead of with their layout.
_ON_DEMAND = ("forks one at a time", "a v5e process's place", "the rank's error kept")

_layout: dict[str, Any] = {}  # "name": the layout in place, "hooks": its step hooks' handle


def entries(name: str) -> tuple[Patch, ...]:
    """The table's entries of the patch called ``name``."""
    found = tuple(patch for patch in PATCHES if patch.name == name)
    if not found:
        raise KeyError(f"no patch called {name!r}")
    return found


def install(name: str, *context: Any) -> None:
    """Puts the patch called ``name`` in place, unless it is there already, made with
    ``context``; a value patch (``make`` None) takes its values from ``context``, in the
    order of its names."""
    for patch in entries(name):
        if patch.when_imported and patch.owners[0].rsplit(".", 1)[0] not in sys.modules:
            continue
        for index, attribute in enumerate(patch.attributes()):
            owners = tuple(resolve(owner) for owner in patch.owners)
            if patch.optional and not hasattr(owners[0], attribute):
                continue
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
                    resolve(patch.owners[0]),
                    patch.attributes(),
                    patch.name,
                    lambda attribute, current, make=make: make(attribute, current, *context),
                )
            )
        yield


def use_layout(layout: str) -> None:
    """The simulation's patches and those of ``layout`` in place, and none of the other
    layout's: each attribute the simulation patches is rebuilt from upstream's where its
    patches differ from the ones wanted (a notebook or a test suite may simulate in one
    layout, then in the other)."""
    wanted = [
        patch
        for patch in PATCHES
        if patch.scope in (SIMULATION, layout) and not patch.undone and patch.name not in _ON_DEMAND
    ]
    managed = [patch for patch in PATCHES if patch.scope in (SIMULATION, *LAYOUTS)]
    for owner, attribute in _slots(managed):
        names = [patch.name for patch in wanted if _holds(patch, owner, attribute)]
        present = [name for name in patching.patches(getattr(owner, attribute)) if name]
        if present[::-1] != names:
            patching.assign((owner,), attribute, patching.upstream(getattr(owner, attribute)))
    for name in dict.fromkeys(patch.name for patch in wanted):
        install(name)
    if _layout.get("name") != layout:
        if "hooks" in _layout:
            step_hooks.remove(_layout.pop("hooks"))
        _layout.update(name=layout, hooks=add_step_hooks(**resolve(LAYOUTS[layout])))


def add_step_hooks(**hooks: Any) -> dict:
    """``step_hooks.add(**hooks)``, with ``torch_xla.sync`` hooked first (on a TPU too)."""
    install("step hooks")
    return step_hooks.add(**hooks)


def private_names(scopes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Module (or class) -> the private names the patches of ``scopes`` replace: a name or
    an owner with a part that starts with "_" (torch_xla's ``_internal``, its ``_XLAC``),
    torch's and the standard library's included. Optional names and owners imported only
    when present (Lightning) are left to their own checks."""
    names: dict[str, tuple[str, ...]] = {}
    for patch in PATCHES:
        if patch.scope not in scopes or patch.optional or patch.when_imported:
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
    """(owner, attribute) of each replacement ``patches`` make, in owners imported now."""
    slots = []
    for patch in patches:
        if patch.when_imported and patch.owners[0].rsplit(".", 1)[0] not in sys.modules:
            continue
        for owner_name in patch.owners:
            owner = resolve(owner_name)
            slots += [
                (owner, attribute)
                for attribute in patch.attributes()
                if hasattr(owner, attribute) and (owner, attribute) not in slots
            ]
    return slots


def _holds(patch, owner, attribute):
    return attribute in patch.attributes() and any(resolve(name) is owner for name in patch.owners)


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
