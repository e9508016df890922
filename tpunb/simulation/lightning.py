"""PyTorch Lightning's TPU support on simulated cores. ``install`` is called by
``simulate`` only (refused on a machine with a TPU) and changes two things, nothing else
(the XLA strategy, its fork launcher, the sampler it inserts and the gradient all-reduce
stay Lightning's own):

- Lightning's ``XLAAccelerator`` counts the TPU chips on PCI through torch_xla, which
  answers the simulated ones (tpu_answers.py), and caches the count: a count taken before
  ``simulate`` (0: ``Trainer(accelerator="tpu")`` would refuse to start) is forgotten.
- Lightning's XLA launcher gets ``lightning_weights.trained_weights_back``, so that after
  ``fit`` the notebook's model holds the trained weights (tpunb.lightning's own launcher
  applies it too, on a TPU as well).

Lightning may be imported before or after ``simulate``: a module already imported is
patched at once, one imported later as it loads.
"""

import importlib.abc
import importlib.util
import sys

from tpunb.upstream import registry


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


def _patch_launcher(module):
    registry.install("trained weights back")  # in the launcher modules imported by now


def collecting_the_trained_weights(_, upstream):
    """The registry's maker for the XLA launcher's ``_collect_rank_zero_results``."""

    from tpunb.launcher.lightning_weights import trained_weights_back

    def _collect_rank_zero_results(self, trainer, results):
        return trained_weights_back(upstream, self, trainer, results)

    return _collect_rank_zero_results


# In the ``lightning`` package and in the standalone ``lightning_fabric`` and
# ``pytorch_lightning`` ones.
_PATCHES = {
    "lightning.fabric.accelerators.xla": _patch_accelerator,
    "lightning_fabric.accelerators.xla": _patch_accelerator,
    "lightning.pytorch.strategies.launchers.xla": _patch_launcher,
    "pytorch_lightning.strategies.launchers.xla": _patch_launcher,
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
