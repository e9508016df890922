"""PyTorch Lightning's TPU support on simulated cores. ``install`` is called by
``simulate`` only (refused on a machine with a TPU) and changes two things, nothing else
(the XLA strategy, its fork launcher, the sampler it inserts and the gradient all-reduce
stay Lightning's own):

- Lightning's ``XLAAccelerator`` counts the TPU chips on PCI through torch_xla, which
  answers the simulated ones (tpu_answers.py), and caches the count: a count taken before
  ``simulate`` (0: ``Trainer(accelerator="tpu")`` would refuse to start) is forgotten.
- Lightning's XLA launcher gets ``trained_weights_back``, so that after ``fit`` the
  notebook's model holds the trained weights.

``trained_weights_back`` itself is a fix for ranks that are threads, which tpunb.lightning's
own launcher also applies, on a TPU too: it is needed on v2/v3 hosts (two ranks a
process) and changes nothing where each rank has its process.

Lightning may be imported before or after ``simulate``: a module already imported is
patched at once, one imported later as it loads.
"""

import copy
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


def trained_weights_back(upstream, launcher, trainer, results):
    """Lightning's ``_XLALauncher._collect_rank_zero_results``, reading the weights of the
    model that trained.

    Where a process runs several ranks as threads (TPU v2/v3: 2, simulated cores: all),
    Lightning's launcher deep-copies the trainer and the model in each thread, trains the
    copy, then saves the state dict of ``launcher._strategy``: the strategy of the
    original, untrained model. The notebook's model then gets its initial weights back
    after ``fit`` (seen with lightning 2.6.6; no upstream issue found as of 2026-11). The
    copy's strategy is the trainer's, so the launcher is given it here.
    """
    launcher = copy.copy(launcher)  # shared by the process's threads: never mutate it
    launcher._strategy = trainer.strategy
    return upstream(launcher, trainer, results)


def _patch_accelerator(module):
    accelerator = module.XLAAccelerator
    # Cached: a Trainer built before simulate() may have found no TPU.
    accelerator.auto_device_count.cache_clear()
    accelerator.is_available.cache_clear()


def _patch_launcher(module):
    launcher = module._XLALauncher
    upstream = launcher._collect_rank_zero_results
    if getattr(upstream, "_tpunb", False):
        return

    def _collect_rank_zero_results(self, trainer, results):
        return trained_weights_back(upstream, self, trainer, results)

    _collect_rank_zero_results._tpunb = True
    launcher._collect_rank_zero_results = _collect_rank_zero_results


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
