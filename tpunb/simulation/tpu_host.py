"""What Python asks about the hardware answers "a TPU v5e host", while torch_xla's runtime
keeps its CPU client.

Used only under ``tpunb.simulate``. Programs and libraries ask whether they run on a TPU
and take their TPU branch only then: ``xr.device_type()`` (Accelerate's
``is_torch_xla_available(check_is_tpu=True)``, which sets each rank's
``local_process_index``; torch_xla's own launch), ``xm.xla_device_hw(device)`` (torch_xla's
autocast, programs gated on ``in ('TPU', ...)``), ``os.environ["PJRT_DEVICE"]``
(Accelerate's ``notebook_launcher``), the TPU chips on PCI (torch_xla's and Lightning's
device counts). On the CPU they would all answer CPU, and such code would silently skip
its work.

The variable both sides read is ``PJRT_DEVICE``: torch_xla's C++ runtime reads it once,
when it starts, to pick its client (``PjRtComputationClient::Initialize``), Python code at
any time. The two read different copies: Python reads ``os.environ``, the runtime the
process's C environment, which ``os.putenv`` alone changes. So ``os.environ`` says what a
v5e host's says (``PJRT_DEVICE=TPU`` and the TPU's description, which torch_xla reads
instead of asking the cloud's metadata server when ``TPU_SKIP_MDS_QUERY`` is set), and the
C environment says ``PJRT_DEVICE=CPU``. ``CPU_NUM_DEVICES``, the number of CPU devices the
runtime makes, is in both (no TPU program reads it). A program that sets
``os.environ["PJRT_DEVICE"] = "TPU"`` itself (many TPU notebooks do) keeps the runtime on
the CPU, and every launched process sets the runtime's copy again before it starts.
Options that only a TPU's runtime takes (``ENABLE_COLLECTIVE_MATMUL_IN_MP``) stay in
``os.environ`` and out of the runtime's copy.

What stays the CPU's: the runtime's own device names (``xm.xla_real_devices()``,
``torch_xla.real_devices()``: "CPU:0"), which torch_xla hands back to the runtime;
``xm.xla_device_kind()`` ("cpu": Pallas kernels check it and refuse with their own
message); the runtime's device attributes and memory statistics; libtpu (never loaded);
``tpu-info`` (it reads a running libtpu).
"""

import functools
import os

from tpunb import machine
from tpunb.errors import warn
from tpunb.upstream import registry

_RUNTIME_DEVICE = "CPU"
# What only a TPU's runtime can take, kept out of the runtime's copy: with
# ENABLE_COLLECTIVE_MATMUL_IN_MP the runtime compiles every graph with TPU compiler options
# (``PjRtComputationClient::Compile`` in
# https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/runtime/pjrt_computation_client.cpp),
# which the CPU client refuses ("No such compile option: 'xla_tpu_decompose_all_gather_einsum'");
# they change how a TPU computes a collective matmul, not what it computes.
_TPU_RUNTIME_ONLY = ("ENABLE_COLLECTIVE_MATMUL_IN_MP",)
_putenv = os.putenv


def environment(cores):
    """What ``os.environ`` holds on a v5e host of ``cores`` chips, a process a chip, as
    torch_xla reads it without a metadata server."""
    return {
        "PJRT_DEVICE": "TPU",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": f"v5litepod-{cores}",
        "TPU_WORKER_ID": "0",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        # torch_xla launches min(chips, processes in these bounds) processes.
        "TPU_PROCESS_BOUNDS": f"{cores},1,1",
    }


def set_environment(cores):
    """Sets ``os.environ`` as ``environment`` says and the runtime's copy to the CPU's, with
    a device a core: a process that starts its runtime itself, not as a rank, drives every
    chip of the host, as one process on a v5e-8 does (the one process of SPMD). Before
    torch_xla is imported: it selects a device at import if none is set."""
    registry.install("runtime_on_cpu")
    os.environ.update(environment(cores))
    runtime_reads_cpu(cores)


def runtime_reads_cpu(devices=1):
    """The C environment, which torch_xla's runtime reads as it starts, selects its CPU
    client with ``devices`` devices: one, this process's chip, in a rank process (called
    before a launched process starts its runtime)."""
    _putenv("PJRT_DEVICE", _RUNTIME_DEVICE)
    for name in _TPU_RUNTIME_ONLY:
        os.unsetenv(name)
    os.environ["CPU_NUM_DEVICES"] = str(devices)


def putenv_keeping_cpu(_, putenv):
    """The registry's maker for ``os.putenv``: ``_runtime_stays_on_the_cpu``."""
    return _runtime_stays_on_the_cpu


def _runtime_stays_on_the_cpu(key, value):
    """``os.putenv``, through which every change of ``os.environ`` reaches the C
    environment, less ``PJRT_DEVICE`` and what only a TPU's runtime takes: the runtime's
    copy stays the CPU's."""
    name = key.decode() if isinstance(key, bytes) else key
    if name in _TPU_RUNTIME_ONLY:
        return
    if name == "PJRT_DEVICE":
        value = _RUNTIME_DEVICE
    _putenv(key, value)


# The TPU chips on PCI are the simulated ones, and each device's hardware
# (``xm.xla_device_hw``) is a TPU. The runtime's device names (``xm.xla_real_devices``,
# ``torch_xla.real_devices()``: "CPU:0") stay its own: torch_xla hands them back to the
# runtime (``xm.set_replication``), which knows its devices by them.
def simulated_chips(_, num_available_chips):
    """The registry's maker for torch_xla's count of the TPU chips on PCI."""

    @functools.wraps(num_available_chips)
    def simulated():
        """The TPU chips attached through PCI: the simulated ones."""
        return machine.simulation().cores

    return simulated


# What a program meets only here, said where it meets it: torch_xla's CPU client writes the
# persistent compilation cache but cannot load it back ("Deserializing serialized executable
# not supported", PjRtComputationClient::DeserializeComputation in
# https://github.com/pytorch/xla/blob/v2.9.0/torch_xla/csrc/runtime/pjrt_computation_client.cpp).
CACHE_NEVER_LOADS = (
    "xr.initialize_cache({path!r}): on simulated cores the compilation cache is written but "
    "never loaded back (torch_xla's CPU client cannot deserialize its executables), so every "
    "run compiles its graphs again. On a TPU the same call loads them: nothing to change."
)


def cache_warning(_, initialize_cache):
    """The registry's maker for ``xr.initialize_cache``: as torch_xla's, and a warning."""

    @functools.wraps(initialize_cache)
    def initialize_cache_on_the_cpu(path, readonly=False):
        warn(CACHE_NEVER_LOADS.format(path=path))
        return initialize_cache(path, readonly)

    return initialize_cache_on_the_cpu


def tpu_hardware(_, xla_device_hw):
    @functools.wraps(xla_device_hw)
    def tpu_hardware(device):
        hardware = xla_device_hw(device)
        return "TPU" if hardware == _RUNTIME_DEVICE else hardware

    return tpu_hardware
