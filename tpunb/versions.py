"""The torch and torch_xla installed here, and which of them tpunb supports, read from
package metadata without importing either."""

import importlib.metadata
import importlib.util

# The simulation's collective fix touches private torch_xla names that these versions have
# (Kaggle's image ships 2.8, Colab's 2.9).
SUPPORTED_TORCH_XLA = ("2.8", "2.9")

INSTALL_TORCH_XLA = (
    "torch_xla is not installed. On a TPU VM: pip install 'torch_xla[tpu]'. Without a TPU, "
    "to simulate cores on the CPU, install the pinned pair: pip install 'tpunb[sim]' "
    "(torch==2.9.0 and torch_xla==2.9.0)."
)


def installed(distribution):
    """The installed version of ``distribution`` (e.g. "torch_xla"), or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def has_torch_xla():
    return importlib.util.find_spec("torch_xla") is not None


def minor(version):
    """ "2.9" for "2.9.0+cpu"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def simulation_supports(torch_xla_version):
    return minor(torch_xla_version) in SUPPORTED_TORCH_XLA
