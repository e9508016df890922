"""The TPU attached to this host, read from PCI like torch_xla does, without starting the
XLA runtime and without asking the network (the metadata server 404s on Colab,
https://github.com/pytorch/xla/issues/6568)."""

from __future__ import annotations

import dataclasses
import functools
import glob
import os

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device id -> generation; the ids are torch_xla's (torch_xla/_internal/tpu.py).
_TPU_PCI_DEVICES = {
    "0x0027": "v2/v3",
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x0056": "v5p",
    "0x0062": "v5p",
    "0x006f": "v6e",
    "0x0076": "7x",
}


@dataclasses.dataclass(frozen=True)
class Tpu:
    """A host's TPU chips and the launch layout xmp.spawn gives them: one process per
    chip, one thread per core (XLA device) of the chip."""

    generation: str
    chips: int

    @property
    def cores_per_chip(self):
        # v2 and v3 chips have two TensorCores, each its own XLA device; later chips
        # expose one device per chip (torch_xla: num_logical_cores_per_chip).
        return 2 if self.generation in ("v2", "v3", "v2/v3") else 1

    @property
    def cores(self):
        return self.chips * self.cores_per_chip

    @property
    def accelerator_type(self):
        """The Cloud TPU name, e.g. ``"v3-8"`` or ``"v5e-1"``: v2 to v5p names count
        TensorCores (two a chip), v5e and later count chips."""
        per_chip = 2 if self.generation in ("v2", "v3", "v2/v3", "v4", "v5p") else 1
        return f"{self.generation}-{self.chips * per_chip}"


def detect(pci_root: str = "/sys/bus/pci/devices") -> Tpu | None:
    """The TPU on this host, or None. Safe before any launch: reads files only.

    Args:
        pci_root: where Linux lists the PCI devices.

    Returns:
        A ``Tpu`` (its accelerator type, chips and cores), or None without one.
    """
    generations = _pci_tpu_generations(pci_root)
    if not generations:
        return None
    generation = generations[0]
    if generation == "v2/v3":
        generation = _v2_or_v3_from_environment() or generation
    return Tpu(generation=generation, chips=len(generations))


@functools.cache
def _pci_tpu_generations(pci_root):
    # Cached: the chips attached to a host do not change while Python runs.
    generations = []
    for vendor_path in sorted(glob.glob(os.path.join(pci_root, "*", "vendor"))):
        if _read(vendor_path) != _GOOGLE_PCI_VENDOR:
            continue
        device_id = _read(os.path.join(os.path.dirname(vendor_path), "device"))
        if device_id in _TPU_PCI_DEVICES:
            generations.append(_TPU_PCI_DEVICES[device_id])
    return tuple(generations)


def _v2_or_v3_from_environment():
    # PCI does not tell v2 from v3 (same device id); Kaggle and TPU VMs name the type.
    for variable in ("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE"):
        value = os.environ.get(variable, "")
        if value.startswith(("v2-", "v3-")):
            return value.split("-")[0]
    return None


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
