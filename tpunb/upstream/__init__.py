"""The private names of torch_xla, torch, PyTorch Lightning and the standard library that
tpunb reads or replaces, in one list (what it replaces generated from ``registry.py``), and
the check that the installed versions have them: made before any fork, so that a
torch_xla or Lightning that renamed one is named in a clear error instead of failing in
every rank. ``tests/test_upstream.py`` checks that the list holds every private name the
code uses and that both supported pairs (Kaggle's torch_xla 2.8, Colab's 2.9) have them.

Nothing here is imported at ``import tpunb``: ``missing`` imports the modules it checks.
"""

from __future__ import annotations

from tpunb.errors import TpunbError
from tpunb.upstream import registry, versions

# The names tpunb reads (calls, or checks for) without replacing them; what it replaces is
# in registry.PATCHES, from which the lists below take their private names.
_LAUNCH_READS = {
    "torch_xla._XLAC": (
        "_xla_runtime_is_initialized",  # platform.runtime_started
        "_check_tensor_need_materialization",  # launcher/reads.py: a read that cuts
        "_check_device_tensor_need_materialization",
        "_is_placecholder",  # (sic) a read that waits for the device
        "_xla_get_cpu_tensors",  # launcher/recorder.py: logged values in one transfer
        "_xla_get_default_device",  # device_memory.py
        "_xla_memory_info",
    ),
}
_SIMULATION_READS = {
    "torch_xla._XLAC": (
        "_set_all_reduce_token",
        "_xla_step_marker",  # the cuts before a collective
        "_xla_get_default_device",
        "_xla_get_cpu_tensors",
        "_xla_tensors_from_aten",
        "_replace_xla_tensor",  # host_collectives.py: the out= forms
        "_xla_increment_counter",  # the counters a TPU's collectives count
        "_get_tensors_xla_device_data_node",
    ),
    "torch_xla.core.xla_model": ("_get_all_reduce_token",),  # functional_collectives.py
    "torch_xla._internal.tpu": ("num_local_processes",),
    "torch.ops._c10d_functional": (  # functional_collectives.py: the kernels it registers
        "broadcast",
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ),
}


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
    ),
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
            if owner is None or not hasattr(owner, attribute)
        ]
    return absent


def check(names, what):
    """Raises a ``TpunbError`` naming what ``what`` needs and the installed packages lack."""
    absent = missing(names)
    if absent:
        found = versions.installed("torch_xla")
        raise TpunbError(
            f"{what} uses private names of torch_xla and Lightning that this installation "
            f"lacks: {', '.join(absent)} (torch_xla {found}). tpunb supports torch_xla "
            f"{' and '.join(versions.SUPPORTED_TORCH_XLA)}: on Kaggle and Colab use the "
            "torch_xla their TPU image ships; elsewhere install a supported pair, e.g. pip "
            'install torch==2.9.0 "torch_xla[tpu]==2.9.0".'
        )


def _owner(dotted):
    """The module, or the class inside one, that ``dotted`` names; None if absent."""
    try:
        return registry.resolve(dotted)
    except (ImportError, AttributeError):
        return None
