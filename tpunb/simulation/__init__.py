"""The simulation: N TPU cores on the CPU with the real torch_xla (docs/simulation.md).

    __init__.py     simulate(cores): the environment torch_xla reads, then the patches
    collectives.py  each collective a graph of its own that the ranks run together
    compiled.py     torch.compile in ranks that share a process
    point_to_point.py  xm.send, xm.recv, dist.send and dist.recv through host memory
    process_groups.py  torch.distributed's default process group, one per core
    random_state.py  torch's random generator for each core's setup
    rank_threads.py  what happens as a process's rank threads start and end
    rank_cpu.py     a process's rank threads on one CPU, on a machine of two
    tpu_answers.py  what Python asks about the hardware answers a TPU; the runtime the CPU
    spawned.py      the simulation in the children of the spawn start method
    torchrun.py     the ranks torchrun starts, each a process of the process layout
    lightning.py    PyTorch Lightning's TPU accelerator opened to the simulated cores

Nothing here is applied on a machine with a TPU: ``simulate`` refuses to run there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tpunb import hardware, upstream
from tpunb.environment import env
from tpunb.errors import TpunbError, check_count
from tpunb.machine import cores as core_layout
from tpunb.machine import platform
from tpunb.simulation import torchrun, tpu_answers
from tpunb.upstream import versions

if TYPE_CHECKING:
    from tpunb.environment import Environment

# XLA's CPU compiler level for the simulated cores' graphs (XLA's default is 3). Level 1
# compiles in about 0.77 of the time, later steps as fast on 2 CPUs (docs/simulation.md,
# "Compiling"; benchmarks/compile_level.py, in git at e37ef2a).
COMPILE_LEVEL = 1
_COMPILE_LEVEL_FLAG = "--xla_backend_optimization_level"


LAYOUTS = ("processes", "threads")


def simulate(
    cores: int = 8, instead_of_tpu: bool = False, layout: str | None = None
) -> Environment:
    """Simulate a TPU with ``cores`` cores on this machine's CPU, for every later launch.

    ``layout="processes"`` runs each core's rank in a process of its own, as a TPU v5e-8
    does (each rank sees its own ``xla:0``, metrics and random generator);
    ``layout="threads"`` runs every rank as a thread of one process, faster on fewer CPUs than
    cores where a program does not depend on what differs (docs/simulation.md). ``None``
    takes ``$TPUNB_SIMULATION_LAYOUT``, else the processes (``default_layout``).

    torch_xla's runtime gets its CPU client with ``cores`` devices, while what Python asks
    about the hardware answers a TPU v5e (``tpu_answers.py``), and collectives between the
    devices work. Graphs compile at XLA's
    CPU level ``COMPILE_LEVEL`` unless ``XLA_FLAGS`` sets ``--xla_backend_optimization_level``.
    Call it before anything touches the XLA device.

    On a machine with a TPU it is refused unless ``instead_of_tpu=True``: then the launches
    of this kernel run on the simulated cores, on the host's CPU (far slower than the TPU),
    e.g. to watch 8 cores on Colab's one-core TPU. A new kernel uses the TPU again.

    Args:
        cores: how many TPU cores, a positive integer.
        instead_of_tpu: simulate on a machine that has a TPU.
        layout: ``"processes"``, ``"threads"`` or None (``default_layout``).

    Returns:
        The ``Environment`` report of the simulated machine.
    """
    count = check_count(cores, "simulate(cores=...)", "cores", 8)
    layout = default_layout() if layout is None else layout
    if layout not in LAYOUTS:
        raise TpunbError(
            f"simulate(layout={layout!r}): the layout is 'processes' (one process a core, as "
            "on a TPU v5e-8) or 'threads' (every core a thread of one process)."
        )
    if torchrun.launched() and layout != "processes":
        raise TpunbError(
            "torchrun started this process as one rank: the simulation runs it as a process a "
            "core (layout='processes'), not as threads. Unset TPUNB_SIMULATION_LAYOUT."
        )
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
    if platform.runtime_started():
        raise TpunbError(
            "The XLA runtime is already running in this process, so the number of simulated "
            "cores can no longer change. Restart the kernel (or Python) and call "
            "tpunb.simulate(...) before anything touches the XLA device."
        )
    processes = count if layout == "processes" else 1
    tpu_answers.set_environment(count, processes=processes)
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
    upstream.check(upstream.SIMULATION, "tpunb.simulate")

    from tpunb.launcher import shared_process
    from tpunb.simulation import functional_collectives, lightning, rank_cpu, spawned
    from tpunb.upstream import registry

    spawned.set_simulation(count, instead_of_tpu, layout)
    registry.use_layout(layout)  # the simulation's patches and the layout's, no others
    functional_collectives.register_kernels()
    if layout == "threads":
        rank_cpu.install()
    shared_process.install()  # also for plain xmp.spawn and Lightning's launcher
    lightning.install()
    core_layout.set_simulated(count, processes)
    if torchrun.launched():  # this process is one of the ranks torchrun started
        torchrun.become_rank(count)
    return env()


LAYOUT_VARIABLE = "TPUNB_SIMULATION_LAYOUT"


def default_layout():
    """The layout ``simulate`` takes when none is given: ``$TPUNB_SIMULATION_LAYOUT`` if set,
    else a process a core, as on Kaggle's TPU v5e-8, on every machine. The threads are
    faster where there are fewer CPUs than cores (each process compiles every graph it
    meets) and differ from a v5e-8 in what docs/simulation.md's table lists: a choice, never
    a default."""
    chosen = os.environ.get(LAYOUT_VARIABLE)
    if chosen:
        if chosen not in LAYOUTS:
            raise TpunbError(
                f"{LAYOUT_VARIABLE}={chosen!r}: the layout is 'processes' (one process a "
                "core, as on a TPU v5e-8) or 'threads' (every core a thread of one process); "
                "unset it for the processes."
            )
        return chosen
    return "processes"


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
