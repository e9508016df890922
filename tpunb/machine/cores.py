"""How many cores a launch runs on, laid out how, and whether this code runs in a rank:
the one place that knows. Never starts the XLA runtime.

``xmp.spawn`` starts one process per TPU chip and, in each, one thread per core (XLA
device) of the chip: v2-8/v3-8 4 x 2, v4-8 4 x 1, v5e-8 8 x 1, v5e-1/v6e-1 1 x 1. The
simulation runs N x 1, as a v5e-8.
"""

import dataclasses
import os

from tpunb import hardware
from tpunb.errors import TpunbError, check_count
from tpunb.machine import platform


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
    return platform.runtime_started() and "PJRT_LOCAL_PROCESS_COUNT" in os.environ
