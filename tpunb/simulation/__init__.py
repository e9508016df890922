"""The simulation: N TPU cores on the CPU with the real torch_xla (docs/simulation.md).

Each simulated core is a process of its own, as on Kaggle's TPU v5e-8: its rank sees its
own ``xla:0``, metrics, counters and random generator.

    __init__.py     simulate(cores): the environment torch_xla reads, then the patches
    tpu_host.py  what Python asks about the hardware answers a TPU; the runtime the CPU
    rank_processes.py  each rank process set up as a v5e-8's, started by xmp.spawn
    torchrun.py     the ranks torchrun starts, each a rank process too
    host_collectives.py  collectives computed on the host, as XLA defines them
    host_exchange.py  the shared memory and store the rank processes meet through
    point_to_point.py  xm.send, xm.recv, dist.send and dist.recv through host memory
    functional_collectives.py  torch's functional collectives, eager and compiled
    spawned.py      the simulation in the children of the spawn start method
    lightning.py    PyTorch Lightning's TPU accelerator opened to the simulated cores

Nothing here is applied on a machine with a TPU: ``simulate`` refuses to run there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tpunb import hardware, machine, upstream
from tpunb.environment import env
from tpunb.errors import TpunbError, check_count, warn
from tpunb.simulation import torchrun, tpu_host
from tpunb.upstream import registry, versions

if TYPE_CHECKING:
    from tpunb.environment import Environment

# XLA's CPU compiler level for the simulated cores' graphs (XLA's default is 3). Level 1
# compiles in about 0.77 of the time, later steps as fast on 2 CPUs (docs/simulation.md,
# "Compiling"; benchmarks/compile_level.py, in git at e37ef2a).
COMPILE_LEVEL = 1
_COMPILE_LEVEL_FLAG = "--xla_backend_optimization_level"


# Where a simulated rank waits for the others at a collective: a hang report names a stack
# that ends there "waiting in a collective" (launcher/failures.py).
WAITS_IN = ("tpunb.simulation.host_exchange",)

# The environment variable that chose a layout while the simulation had two (threads were
# retired: a v5e-8 runs a process a core).
LAYOUT_VARIABLE = "TPUNB_SIMULATION_LAYOUT"


def simulate(
    cores: int = 8, instead_of_tpu: bool = False, layout: str | None = None
) -> Environment:
    """Simulate a TPU with ``cores`` cores on this machine's CPU, for every later launch.

    Each core's rank runs in a process of its own, as on Kaggle's TPU v5e-8: each sees its
    own ``xla:0``, metrics and random generator. torch_xla's runtime in each gets the CPU
    client with one device, while what Python asks about the hardware answers a TPU v5e
    (``tpu_host.py``), and collectives between the cores work. Graphs compile at XLA's
    CPU level ``COMPILE_LEVEL`` unless ``XLA_FLAGS`` sets ``--xla_backend_optimization_level``.
    Call it before anything touches the XLA device.

    On a machine with a TPU it is refused unless ``instead_of_tpu=True``: then the launches
    of this kernel run on the simulated cores, on the host's CPU (far slower than the TPU),
    e.g. to watch 8 cores on Colab's one-core TPU. A new kernel uses the TPU again.

    Args:
        cores: how many TPU cores, a positive integer.
        instead_of_tpu: simulate on a machine that has a TPU.
        layout: refused: the threads layout it chose is retired.

    Returns:
        The ``Environment`` report of the simulated machine.
    """
    count = _cores_that_fit(check_count(cores, "simulate(cores=...)", "cores", 8))
    _refuse_layout(layout)
    tpu = hardware.detect()
    if tpu is not None and not instead_of_tpu:
        raise TpunbError(
            f"This machine has a TPU ({tpu.accelerator_type}, {tpu.cores} "
            f"{'core' if tpu.cores == 1 else 'cores'}): launch on it directly with "
            "tpunb.launch(...). To simulate cores on this machine's CPU instead (far slower "
            f"than the TPU; a new kernel uses the TPU again): tpunb.simulate(cores={count}, "
            "instead_of_tpu=True)."
        )
    _check_torch_xla_version()
    if machine.runtime_started():
        raise TpunbError(
            "The XLA runtime is already running in this process, so the number of simulated "
            "cores can no longer change. Restart the kernel (or Python) and call "
            "tpunb.simulate(...) before anything touches the XLA device."
        )
    tpu_host.set_environment(count)
    # One torch_xla pool thread per replica at least, or collectives cannot complete.
    pool_size = max(16, 2 * count, int(os.environ.get("XLA_THREAD_POOL_SIZE", "0") or 0))
    os.environ["XLA_THREAD_POOL_SIZE"] = str(pool_size)
    os.environ["PJRT_CPU_ASYNC_CLIENT"] = "false"
    set_compile_level(os.environ)
    # As Kaggle's TPU image presets them, so that its notebooks' "os.environ.pop(...)" cell
    # runs here too. torch_xla only sets them again (os.environ.setdefault); libtpu would
    # read them.
    os.environ.setdefault("TPU_PROCESS_ADDRESSES", "local")
    os.environ.setdefault("CLOUD_TPU_TASK_ID", "0")
    # Imports torch_xla: only now that the environment names the simulated device.
    scopes = (registry.SIMULATION, registry.LAUNCH)
    upstream.check(upstream.SIMULATION, "tpunb.simulate", scopes)

    from tpunb.simulation import functional_collectives, lightning, pitfalls

    registry.install_simulation()
    if pitfalls.reporting():
        pitfalls.install()
    functional_collectives.register_kernels()
    lightning.install()
    machine.set_simulation(machine.Simulation(count, instead_of_tpu))
    if torchrun.launched():  # this process is one of the ranks torchrun started
        torchrun.become_rank(count)
    return env()


# The most cores this machine's memory holds, where its owner says so: each simulated core
# is a process of its own (binder/start sets it for Binder's 2 GB).
MAX_CORES_VARIABLE = "TPUNB_MAX_SIMULATED_CORES"


def _cores_that_fit(count):
    """``count``, or fewer where ``$TPUNB_MAX_SIMULATED_CORES`` says fewer fit (warned)."""
    most = os.environ.get(MAX_CORES_VARIABLE)
    if not most:
        return count
    if not most.isdigit() or int(most) < 1:
        raise TpunbError(
            f"{MAX_CORES_VARIABLE}={most!r}: give the most cores this machine's memory holds, "
            f"a positive integer (e.g. {MAX_CORES_VARIABLE}=4), or unset it."
        )
    if count <= int(most):
        return count
    warn(
        f"Simulating {most} cores instead of {count}: {MAX_CORES_VARIABLE}={most} says this "
        f"machine's memory holds {most} (each simulated core is a process of its own; "
        f"binder/start sets it for Binder's 2 GB); unset it for {count}."
    )
    return int(most)


def _refuse_layout(layout):
    """The threads layout is retired: ``layout=`` and ``$TPUNB_SIMULATION_LAYOUT`` are
    refused, with why, rather than ignored."""
    if layout is not None:
        asked, fix = f"simulate(layout={layout!r})", "leave layout= out"
    elif os.environ.get(LAYOUT_VARIABLE):
        asked = f"{LAYOUT_VARIABLE}={os.environ[LAYOUT_VARIABLE]!r}"
        fix = f"unset {LAYOUT_VARIABLE}"
    else:
        return
    raise TpunbError(
        f"{asked}: the simulation has one layout now, a process a core, as on Kaggle's TPU "
        "v5e-8 (the threads layout, where cores shared one process's random generator, "
        "counters and objects, is retired: no TPU of today runs so). "
        f"To use less memory, simulate fewer cores, e.g. tpunb.simulate(cores=4); {fix}."
    )


def set_compile_level(environ):
    """Adds ``COMPILE_LEVEL`` to the XLA flags in ``environ``, unless they set a level.

    Simulated cores compile each graph for the CPU and run it for minutes at most: at XLA's
    default level LLVM spends more time optimizing the code than a short run saves. XLA
    reads its flags when the runtime starts (in the ranks), so this holds even after
    torch_xla is imported."""
    flags = environ.get("XLA_FLAGS", "")
    if _COMPILE_LEVEL_FLAG not in flags:
        environ["XLA_FLAGS"] = f"{flags} {_COMPILE_LEVEL_FLAG}={COMPILE_LEVEL}".strip()


def _check_torch_xla_version():
    version = versions.installed("torch_xla")
    if version is None:
        raise TpunbError(versions.INSTALL_TORCH_XLA)
    if not versions.simulation_supports(version):
        raise TpunbError(
            f"tpunb.simulate supports torch_xla {' and '.join(versions.SUPPORTED_TORCH_XLA)}, "
            f"found {version}. Install a supported pair, e.g. pip install torch==2.9.0 "
            "torch_xla==2.9.0."
        )
