"""What this machine is: where Python runs (Colab, Kaggle, Binder, Jupyter, IPython or a
script), whether its XLA runtime started, how many cores a launch runs on, laid out how,
and whether this code runs in a rank. Reads ``sys.modules``, environment variables and
files only: never imports torch_xla, never starts the XLA runtime.

``xmp.spawn`` starts one process per TPU chip and, in each, one thread per core (XLA
device) of the chip: v2-8/v3-8 4 x 2, v4-8 4 x 1, v5e-8 8 x 1, v5e-1/v6e-1 1 x 1. The
simulation runs N x 1, as a v5e-8. The TPU on PCI: ``hardware.py``.
"""

import contextlib
import dataclasses
import os
import sys

from tpunb import hardware
from tpunb.errors import TpunbError, check_count

# Kaggle's TPU image presets these; torch_xla only `setdefault`s them, so the preset
# single-process values win and a multi-process spawn fails ("Expected 4 worker
# addresses, got 1"). https://github.com/Lightning-AI/pytorch-lightning/issues/19313,
# https://github.com/pytorch/xla/issues/8215
SPAWN_BREAKING_VARIABLES = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


def platform():
    """``"colab"``, ``"kaggle"``, ``"binder"``, ``"jupyter"``, ``"ipython"`` or ``"script"``."""
    if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    if "BINDER_LAUNCH_HOST" in os.environ or "BINDER_REPO_URL" in os.environ:
        return "binder"
    if in_kernel():
        return "jupyter"
    if "IPython" in sys.modules:
        return "ipython"
    return "script"


def in_kernel():
    """True inside a Jupyter kernel (Jupyter, Colab, Kaggle and Binder notebooks)."""
    # A process can import ipykernel without being a kernel (nbval does): ask the running
    # IPython shell, if IPython is already imported, whether it serves a kernel.
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def draws_widgets():
    """True in a kernel whose front end most likely draws ipywidgets as they change: Colab,
    an interactive Kaggle session, a kernel started by a Jupyter server (JupyterLab,
    Notebook, Binder: it sets JPY_SESSION_NAME) or by VS Code. False where notebooks run
    headless (nbval, nbclient, papermill, Kaggle's "Save & Run All")."""
    if not in_kernel():
        return False
    where = platform()
    if where == "colab":
        return True
    if where == "kaggle":
        return os.environ.get("KAGGLE_KERNEL_RUN_TYPE") == "Interactive"
    return "JPY_SESSION_NAME" in os.environ or "VSCODE_PID" in os.environ


def runtime_started():
    """True when the XLA runtime runs in this process (it cannot without torch_xla
    imported, so torch_xla is never imported to find out)."""
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized()


def spawn_breaking_variables():
    """The preset variables (name -> value) that would break a multi-process spawn."""
    return {k: os.environ[k] for k in SPAWN_BREAKING_VARIABLES if k in os.environ}


@contextlib.contextmanager
def spawn_variables_removed():
    """For the duration of a launch: without the variables that break a multi-process
    spawn, put back after."""
    saved = spawn_breaking_variables()
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def variable_set(name, value):
    """For the duration: ``os.environ[name] = value`` (for the processes started meanwhile,
    which inherit it); afterwards what was there before, or nothing."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What ``tpunb.simulate`` set up: its arguments, which spawned children repeat."""

    cores: int
    instead_of_tpu: bool = False


# The simulation in place, in this process and the ones it forks: the one object that holds
# it (None: a TPU's layout, or no cores at all).
_simulation: Simulation | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The cores a launch runs on and the processes and threads that drive them."""

    cores: int  # ranks of a launch: one a core
    processes: int
    tpu: object  # hardware.Tpu, or None for simulated cores

    @property
    def simulated(self):
        return self.tpu is None

    @property
    def ranks_per_process(self):
        """Ranks each process runs, each a thread driving one core."""
        return self.cores // self.processes

    def describe(self):
        """ "4 processes x 2 threads"."""
        processes, threads = self.processes, self.ranks_per_process
        return (
            f"{processes} process{'es' if processes != 1 else ''} x "
            f"{threads} thread{'s' if threads != 1 else ''}"
        )


def available():
    """The layout of a launch on this machine: the simulated cores once ``tpunb.simulate``
    ran (on a TPU host only when asked to replace the TPU), else its TPU, else None."""
    if _simulation is not None:
        return Layout(cores=_simulation.cores, processes=_simulation.cores, tpu=None)
    tpu = hardware.detect()
    if tpu is not None:
        return Layout(cores=tpu.cores, processes=tpu.chips, tpu=tpu)
    return None


def count(cores=None):
    """``cores`` checked, or (None) the cores a launch here runs on; raises without any."""
    if cores is not None:
        return check_count(cores, "cores=...", "cores", 8)
    layout = available()
    if layout is None:
        raise TpunbError(
            "No TPU cores here to count: pass cores=..., or call tpunb.simulate(cores=8) first."
        )
    return layout.cores


def set_simulation(simulation: Simulation) -> None:
    """Called by ``tpunb.simulate`` once the simulation is set up."""
    global _simulation
    _simulation = simulation


def simulation() -> Simulation | None:
    """The simulation in place, or None."""
    return _simulation


def in_rank():
    """True in a rank: a thread that ``xmp.spawn`` (tpunb's launch, Lightning's or a plain
    one) runs on a core. The notebook's own process is never one, even once it has used
    the device: torch_xla sets ``PJRT_LOCAL_PROCESS_COUNT`` only where it starts ranks."""
    return runtime_started() and "PJRT_LOCAL_PROCESS_COUNT" in os.environ
