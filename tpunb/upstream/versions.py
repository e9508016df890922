"""The torch and torch_xla installed here, and which of them tpunb supports, read from
package metadata without importing either."""

import importlib.metadata
import importlib.util

# Where tpunb installs from: its source repository at the release tag of this version,
# until tpunb is published on the package index (then the requirement is "tpunb==VERSION").
# The README and the first cell of every notebook say the same; tests/test_packaging.py
# keeps them so, and the tag equal to tpunb.__version__.
INSTALL_FROM = "git+https://github.com/tpunb/tpunb@v0.2.0"

# What tpunb is checked against: torch_xla's last two releases (its repository is archived,
# so this surface is frozen), each with the torch it is built for (Kaggle's image ships
# 2.8, Colab's 2.9), and the Lightning releases tpunb.lightning runs (2.6 in CI). The private
# names and signatures they share: upstream/__init__.py.
SUPPORTED = {"2.8": {"torch": "2.8"}, "2.9": {"torch": "2.9"}}  # torch_xla -> its pair
SUPPORTED_TORCH_XLA = tuple(SUPPORTED)
SUPPORTED_LIGHTNING = ("2.2", "2.6")  # from, through (minor versions)


def lightning_supported(version):
    """Whether Lightning ``version`` is in ``SUPPORTED_LIGHTNING``."""
    low, high = (tuple(map(int, v.split("."))) for v in SUPPORTED_LIGHTNING)
    return low <= tuple(map(int, minor(version).split("."))) <= high


def requirement(extras=""):
    """What to give pip for tpunb, e.g. ``requirement("sim")``."""
    return f"tpunb[{extras}] @ {INSTALL_FROM}" if extras else f"tpunb @ {INSTALL_FROM}"


INSTALL_TORCH_XLA = (
    "torch_xla is not installed. On a TPU VM: pip install 'torch_xla[tpu]'. Without a TPU, "
    f'to simulate cores on the CPU, install the pinned pair: pip install "{requirement("sim")}" '
    "(torch==2.9.0 and torch_xla==2.9.0)."
)


TORCH_TPU = (
    "torch_tpu {version} (TorchTPU, Google's replacement for the deprecated PyTorch/XLA) is "
    "installed. tpunb drives torch_xla, which Colab's and Kaggle's TPU images still ship, and "
    "cannot launch or simulate TorchTPU: it runs eagerly, one process per device, started "
    "with spawn (set_tpu_launch_env, then torchrun or torch.multiprocessing.spawn), has no "
    "CPU mode, and needs torch 2.11 or later, so it cannot share an environment with "
    "torch_xla 2.8 or 2.9. Its documentation: https://torchtpu.readthedocs.io."
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
