"""The private names of torch_xla and PyTorch Lightning that tpunb reads or replaces, in one
list, and the check that the installed versions have them: made before any fork, so that a
torch_xla or Lightning that renamed one is named in a clear error instead of failing in
every rank. ``tests/test_upstream.py`` checks that the list holds every private name the
code uses and that both supported pairs (Kaggle's torch_xla 2.8, Colab's 2.9) have them.

Nothing here is imported at ``import tpunb``: ``missing`` imports the modules it checks.
"""

from __future__ import annotations

import importlib

from tpunb.errors import TpunbError
from tpunb.upstream import versions

# The primitives every Python collective (xm.*, torch.distributed's XLA backend,
# torch_xla.core.functions, SyncBatchNorm) reaches, which both simulation layouts replace
# (simulation/collectives.py, host_collectives.py); xm.send and xm.recv: point_to_point.py.
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

# Every launch (tpunb.launch, tpunb.lightning), on a TPU too.
LAUNCH = {
    "torch_xla._XLAC": (
        "_xla_runtime_is_initialized",  # platform.runtime_started
        "_check_tensor_need_materialization",  # launcher/reads.py: a read that cuts
        "_check_device_tensor_need_materialization",
        "_is_placecholder",  # (sic) a read that waits for the device
        "_xla_get_cpu_tensors",  # launcher/recorder.py: logged values in one transfer
        "_xla_increment_counter",  # launcher/shared_process.py: counters put back
        "_xla_get_default_device",  # device_memory.py
        "_xla_memory_info",
    ),
    "torch_xla._internal.pjrt": ("initialize_multiprocess",),  # shared_process.py
}

# tpunb.lightning's launcher: Lightning's XLA launcher, run under tpunb's supervisor.
LIGHTNING = {
    "lightning.pytorch.strategies.launchers.xla": ("_XLALauncher",),
    "lightning.pytorch.strategies.launchers.xla._XLALauncher": (
        "_wrapping_function",
        "_collect_rank_zero_results",
        "_recover_results_in_main_process",
    ),
}

# tpunb.simulate (never on a TPU).
SIMULATION = {
    "torch_xla._XLAC": (
        *COLLECTIVE_PRIMITIVES,  # each layout replaces them
        "_set_all_reduce_token",
        "_xla_step_marker",  # the cuts before a collective
        "_xla_get_default_device",
        "_xla_get_cpu_tensors",
        "_xla_tensors_from_aten",
        "_replace_xla_tensor",  # host_collectives.py: the out= forms
        "_xla_counter_value",
        "_get_graph_hash",  # functional_collectives.py: a part that only copies
        "_get_tensors_xla_device_data_node",
    ),
    "torch_xla.core.xla_model": ("_get_all_reduce_token",),  # functional_collectives.py
    "torch_xla.runtime": ("_WORLD_SIZE", "_ORDINAL"),  # rank_processes.py
    "torch_xla._internal.pjrt": ("_run_thread_per_device", "run_multiprocess"),
    "torch_xla._internal.tpu": ("num_local_processes", "num_available_chips"),
    "torch_xla._dynamo.dynamo_bridge": (  # compiled.py, functional_collectives.py
        "extract_compiled_graph",
        "extract_compiled_graph_helper",
        "extract_graph_helper",
        "UnsupportedNodesCollector",
        "InputCollector",
    ),
    "torch.distributed.distributed_c10d": ("_world", "_World"),  # process_groups.py
}


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
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            owner = getattr(owner, attribute, None)
        return owner
    return None
