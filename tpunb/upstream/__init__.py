"""The private names of torch_xla, torch, PyTorch Lightning and the standard library that
tpunb reads or replaces, in one list (what it replaces generated from ``registry.py``), and
the check that the installed versions have them: made before any fork, so that a
torch_xla or Lightning that renamed one is named in a clear error instead of failing in
every rank. ``tests/test_upstream.py`` checks that the list holds every private name the
code uses and that both supported pairs (Kaggle's torch_xla 2.8, Colab's 2.9) have them.

Nothing here is imported at ``import tpunb``: ``missing`` imports the modules it checks.
"""

from __future__ import annotations

import functools
import inspect
import re

from tpunb.errors import TpunbError
from tpunb.upstream import patching, registry, versions

# The names tpunb reads (calls, or checks for) without replacing them; what it replaces is
# in registry.PATCHES, from which the lists below take their private names.
_LAUNCH_READS = {
    "torch_xla._XLAC": (
        "_xla_runtime_is_initialized",  # machine.runtime_started
        "_check_tensor_need_materialization",  # launcher/reads.py: a read that cuts
        "_check_device_tensor_need_materialization",
        "_is_placecholder",  # (sic) a read that waits for the device
        "_xla_get_cpu_tensors",  # launcher/recorder.py: logged values in one transfer
        "_xla_get_default_device",  # device_memory.py
        "_xla_memory_info",
    ),
    # Attributes of instances, read through getattr defaults (set in the class's methods):
    # launcher/recorder.py, the host loader behind a per-device loader.
    "torch_xla.distributed.parallel_loader.PerDeviceLoader": ("_loader",),
    "torch_xla.distributed.parallel_loader.ParallelLoader": ("_cpu_loader",),
}
_SIMULATION_READS = {
    "torch_xla._XLAC": (
        "_set_all_reduce_token",
        "_xla_sync_live_tensors",  # the cuts before a collective
        "_check_tensor_need_materialization",  # whether a collective's inputs need a cut
        "_xla_get_tensor_id",  # host_collectives.py: values the cuts computed early
        "_xla_get_default_device",
        "_xla_get_cpu_tensors",
        "_replace_xla_tensor",  # host_collectives.py: the out= forms
        "_xla_increment_counter",  # the counters a TPU's collectives count
        "_get_tensors_xla_device_data_node",
        "_get_use_eager_mode",  # host_collectives.py: in eager mode, results arrive through
        "_set_use_eager_mode",  # one eager computation, as a TPU's collective runs
        "_xla_sync_multi",
    ),
    "torch_xla.core.xla_model": ("_get_all_reduce_token",),  # functional_collectives.py
    "torch_xla._internal.tpu": ("num_local_processes",),
    # functional_collectives.py: what the backend's collector found unsupported
    "torch_xla._dynamo.dynamo_bridge.UnsupportedNodesCollector": ("_unsupported_nodes",),
    "torch.ops._c10d_functional": (  # functional_collectives.py: the kernels it registers
        "broadcast",
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ),
}


# The parameters of every torch_xla callable tpunb replaces, as its replacement relies on
# them: a Python function's names, a C++ binding's count (from its docstring). The same in
# torch_xla 2.8 and 2.9; tests/test_upstream.py keeps the table whole.
SIGNATURES = {
    "torch_xla._XLAC._get_graph_hash": "1 arguments",
    "torch_xla._XLAC._xla_all_gather": "7 arguments",
    "torch_xla._XLAC._xla_all_gather_coalesced": "6 arguments",
    "torch_xla._XLAC._xla_all_gather_coalesced_out": "7 arguments",
    "torch_xla._XLAC._xla_all_gather_out": "7 arguments",
    "torch_xla._XLAC._xla_all_reduce": "5 arguments",
    "torch_xla._XLAC._xla_all_reduce_inplace": "5 arguments",
    "torch_xla._XLAC._xla_all_to_all": "7 arguments",
    "torch_xla._XLAC._xla_collective_permute": "3 arguments",
    "torch_xla._XLAC._xla_reduce_scatter": "10 arguments",
    "torch_xla._XLAC._xla_reduce_scatter_coalesced": "8 arguments",
    "torch_xla._XLAC._xla_reduce_scatter_coalesced_out": "9 arguments",
    "torch_xla._XLAC._xla_reduce_scatter_out": "9 arguments",
    "torch_xla._XLAC._xla_tensors_from_aten": "tensors, devices, shardings",
    "torch_xla._dynamo.dynamo_bridge.InputCollector.run_node": "self, n",
    "torch_xla._dynamo.dynamo_bridge.UnsupportedNodesCollector.run_node": "self, n",
    "torch_xla._dynamo.dynamo_bridge.extract_compiled_graph_helper": "xla_model, xla_args",
    "torch_xla._dynamo.dynamo_bridge.extract_graph_helper": (
        "xla_model, sym_constants_to_graph_vars"
    ),
    "torch_xla._internal.pjrt._run_thread_per_device": (
        "local_rank, local_world_size, fn, initializer_fn"
    ),
    "torch_xla._internal.pjrt.run_multiprocess": "fn, args, start_method, kwargs",
    "torch_xla._internal.tpu.num_available_chips": "",
    "torch_xla.core.xla_model.add_step_closure": "closure, args, run_async",
    "torch_xla.core.xla_model.all_gather": (
        "value, dim, groups, output, pin_layout, channel_id, use_global_device_ids"
    ),
    "torch_xla.core.xla_model.all_reduce": "reduce_type, inputs, scale, groups, pin_layout",
    "torch_xla.core.xla_model.all_to_all": (
        "value, split_dimension, concat_dimension, split_count, groups, pin_layout"
    ),
    "torch_xla.core.xla_model.collective_broadcast": "tensors, root_ordinal, groups, pin_layout",
    "torch_xla.core.xla_model.collective_permute": "value, pairs",
    "torch_xla.core.xla_model.recv": "output, channel_id",
    "torch_xla.core.xla_model.reduce_scatter": (
        "reduce_type, input, scale, scatter_dim, shard_count, groups, output, pin_layout, "
        "channel_id, use_global_device_ids"
    ),
    "torch_xla.core.xla_model.send": "value, channel_id",
    "torch_xla.core.xla_model.xla_device_hw": "device",
    "torch_xla.core.xla_model.xla_rendezvous": "payload, ordinals, tag",
    "torch_xla.distributed.parallel_loader.PerDeviceLoader.next": "self",
    "torch_xla.runtime.global_device_count": "",
    "torch_xla.runtime.initialize_cache": "path, readonly",
    "torch_xla.runtime.global_runtime_device_count": "",
    "torch_xla.runtime.process_count": "",
    "torch_xla.runtime.process_index": "",
    "torch_xla.sync": "wait, reset_scope",
    "torch_xla.torch_xla.sync": "wait, reset_scope",
}


def parameters(value: object) -> str | None:
    """What a replacement relies on of ``value``: a Python function's parameter names, or a
    C++ binding's (its docstring's first line): their names, or their count where pybind11
    names them ``arg0``, ``arg1``...; None if neither reads."""
    try:
        return ", ".join(inspect.signature(value).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        first = (getattr(value, "__doc__", None) or "").strip().split("\n")[0]
        if not re.match(r"\w+\(.*\) ->", first):
            return None
        names = re.findall(r"(\w+): ", first)
        if all(re.fullmatch(r"arg[0-9]+", name) for name in names):
            return f"{len(names)} arguments"
        return ", ".join(names)


def changed(scopes: tuple[str, ...]) -> list[str]:
    """The torch_xla callables the patches of ``scopes`` replace whose parameters are not
    those of ``SIGNATURES``, in words (the upstream function's, under tpunb's patches)."""
    found = []
    for patch in registry.PATCHES:
        if patch.scope not in scopes or patch.make is None:
            continue
        for owner in patch.owners:
            for name in patch.attributes():
                expected = SIGNATURES.get(f"{owner}.{name}")
                if expected is None:
                    continue  # torch's and the standard library's, pinned with them
                present = _owner(owner)
                value = getattr(present, name, None) if present is not None else None
                if value is None:
                    continue  # missing: named by ``missing``
                actual = parameters(patching.upstream(value))
                if actual != expected:
                    found.append(f"{owner}.{name}({actual}), where tpunb expects ({expected})")
    return found


def _merged(*lists):
    merged = {}
    for names in lists:
        for module, found in names.items():
            merged[module] = tuple(dict.fromkeys((*merged.get(module, ()), *found)))
    return merged


# Every launch (tpunb.launch, tpunb.lightning), on a TPU too.
LAUNCH = _merged(_LAUNCH_READS, registry.private_names((registry.LAUNCH,)))

# tpunb.lightning's launcher: Lightning's XLA launcher, run under tpunb's supervisor.
LIGHTNING = {
    "lightning.pytorch.strategies.launchers.xla": ("_XLALauncher",),
    "lightning.pytorch.strategies.launchers.xla._XLALauncher": (
        "_wrapping_function",
        "_recover_results_in_main_process",
        "_already_fit",  # an instance's, as the ones below (lightning/__init__.py)
        "_strategy",
    ),
    "lightning.pytorch.strategies.xla.XLAStrategy": ("_launcher",),
    # lightning/callback.py: the DataLoader in torch_xla's MpDeviceLoader, and this batch's
    # value of a torchmetrics Metric given to self.log
    "torch_xla.distributed.parallel_loader.MpDeviceLoader": ("_loader",),
    "torchmetrics.Metric": ("_forward_cache",),
}

# tpunb.simulate (never on a TPU).
SIMULATION = _merged(_SIMULATION_READS, registry.private_names((registry.SIMULATION,)))


def missing(names):
    """The names of ``names`` (module -> attribute names) that the installed packages lack,
    as "module.name"; a module that cannot be imported counts all its names."""
    absent = []
    for module_name, attributes in names.items():
        owner = _owner(module_name)
        absent += [
            f"{module_name}.{attribute}"
            for attribute in attributes
            if owner is None or not (hasattr(owner, attribute) or _sets(owner, attribute))
        ]
    return absent


@functools.cache  # an installed class's source does not change while Python runs
def _sets(owner, attribute):
    """Whether the class ``owner`` (or one it inherits from) sets ``attribute`` on its
    instances in its own code (``self.<attribute> =``)."""
    if not isinstance(owner, type):
        return False
    assigned = re.compile(rf"\bself\.{attribute}\s*(?::[^=\n]*)?=")
    for cls in owner.__mro__:
        try:
            if assigned.search(inspect.getsource(cls)):
                return True
        except (OSError, TypeError):  # builtins, classes without source
            continue
    return False


def problems(names, scopes=()):
    """What the installed packages lack of the private ``names``, and the callables the
    patches of ``scopes`` replace whose parameters changed, in words."""
    return missing(names) + [f"{call} (changed)" for call in changed(scopes)]


def check(names, what, scopes=()):
    """Raises a ``TpunbError`` naming what ``what`` needs and the installed packages lack:
    the private ``names``, and the parameters of what the patches of ``scopes`` replace."""
    absent = problems(names, scopes)
    if absent:
        found = versions.installed("torch_xla")
        raise TpunbError(
            f"{what} uses private names of torch_xla and Lightning that this installation "
            f"lacks or has changed: {', '.join(absent)} (torch_xla {found}). tpunb supports "
            f"torch_xla {' and '.join(versions.SUPPORTED_TORCH_XLA)}: on Kaggle and Colab use the "
            "torch_xla their TPU image ships; elsewhere install a supported pair, e.g. pip "
            'install torch==2.9.0 "torch_xla[tpu]==2.9.0".'
        )


def _owner(dotted):
    """The module, or the class inside one, that ``dotted`` names; None if absent."""
    try:
        return registry.resolve(dotted)
    except (ImportError, AttributeError):
        return None
