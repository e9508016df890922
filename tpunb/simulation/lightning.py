"""PyTorch Lightning's TPU support on simulated cores. ``install`` is called by
``simulate`` only (refused on a machine with a TPU) and changes one thing, nothing else
(the XLA strategy, its fork launcher, the sampler it inserts and the gradient all-reduce
stay Lightning's own): Lightning's ``XLAAccelerator`` counts the TPU chips on PCI through
torch_xla, which answers the simulated ones (tpu_host.py), and caches the count: a count
taken before ``simulate`` (0: ``Trainer(accelerator="tpu")`` would refuse to start) is
forgotten.

Lightning may be imported before or after ``simulate``: a module already imported is
forgotten at once, one imported later as it loads.
"""

import importlib.abc
import importlib.util
import sys


def install():
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _patch_accelerator(module):
    accelerator = module.XLAAccelerator
    # Cached: a Trainer built before simulate() may have found no TPU.
    accelerator.auto_device_count.cache_clear()
    accelerator.is_available.cache_clear()


# In the ``lightning`` package and in the standalone ``lightning_fabric`` one.
_PATCHES = {
    "lightning.fabric.accelerators.xla": _patch_accelerator,
    "lightning_fabric.accelerators.xla": _patch_accelerator,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module of ``_PATCHES`` right after it executes."""

    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec
