"""``simulate(cores=N)``: N TPU cores simulated on the CPU with the real torch_xla."""

import importlib.metadata
import os

from tpunb import hardware, platform
from tpunb.errors import TpunbError

# The collective fix in _cpu_collectives touches private torch_xla names that these
# versions have (Kaggle's image ships 2.8, Colab's 2.9); CI tests 2.9.
SUPPORTED_TORCH_XLA = ("2.8", "2.9")

_simulated_cores = None


def simulate(cores=8):
    """Simulate a TPU with ``cores`` cores on this machine's CPU, for every later launch.

    Selects torch_xla's CPU device with ``cores`` devices (``PJRT_DEVICE=CPU``,
    ``CPU_NUM_DEVICES``) and makes collectives between them work. Call it before
    anything touches the XLA device. Returns the environment report.
    """
    global _simulated_cores
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise TpunbError(f"simulate(cores={cores!r}): cores must be a positive integer, e.g. 8.")
    tpu = hardware.detect()
    if tpu is not None:
        raise TpunbError(
            f"This machine has a TPU ({tpu.accelerator_type}, {tpu.cores} cores): launch on it "
            "directly with tpunb.launch(...). Simulation is for machines without a TPU."
        )
    _check_torch_xla_version()
    if platform.runtime_started():
        raise TpunbError(
            "The XLA runtime is already running in this process, so the number of simulated "
            "cores can no longer change. Restart the kernel (or Python) and call "
            "tpunb.simulate(...) before anything touches the XLA device."
        )
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(cores)
    # One torch_xla pool thread per replica at least, or collectives cannot complete.
    pool_size = max(16, 2 * cores, int(os.environ.get("XLA_THREAD_POOL_SIZE", "0") or 0))
    os.environ["XLA_THREAD_POOL_SIZE"] = str(pool_size)
    os.environ["PJRT_CPU_ASYNC_CLIENT"] = "false"

    from tpunb import _cpu_collectives, _fallback_counters, _lightning_simulation

    _cpu_collectives.install()
    _fallback_counters.install()  # also for plain xmp.spawn and Lightning's launcher
    _lightning_simulation.install(cores)
    _simulated_cores = cores

    from tpunb.environment import env

    return env()


def simulated_cores():
    """The number of simulated cores, or None when ``simulate`` has not been called."""
    return _simulated_cores


def _check_torch_xla_version():
    try:
        version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        raise TpunbError(
            "torch_xla is not installed. For simulated cores on the CPU install the pinned "
            "pair: pip install 'tpunb[sim]' (torch==2.9.0 and torch_xla==2.9.0)."
        ) from None
    if ".".join(version.split(".")[:2]) not in SUPPORTED_TORCH_XLA:
        raise TpunbError(
            f"tpunb.simulate supports torch_xla {' and '.join(SUPPORTED_TORCH_XLA)}, found "
            f"{version}. Install a supported pair, e.g. pip install torch==2.9.0 torch_xla==2.9.0."
        )
