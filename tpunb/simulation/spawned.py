"""The simulation in the processes that the ``spawn`` start method creates.

Used only under ``tpunb.simulate``. ``xmp.spawn`` and ``torch_xla.launch`` start their
processes with ``spawn`` unless told otherwise. A spawned child is a new Python: it reads
``PJRT_DEVICE`` and ``CPU_NUM_DEVICES`` from the environment it inherits, but none of the
simulation's patches. So the command line that starts it (``multiprocessing.spawn.
get_command_line``) first simulates the same cores in it, then runs multiprocessing's
own start-up. Its children get the simulation the same way.
"""

import functools
import multiprocessing.spawn

from tpunb.upstream import patching


def install(cores, instead_of_tpu, layout):
    """Each ``simulate`` call sets the simulation spawned children start with."""
    patching.replace(
        multiprocessing.spawn,
        "get_command_line",
        "simulating first",
        functools.partial(
            _simulating_first, cores=cores, instead_of_tpu=instead_of_tpu, layout=layout
        ),
        renew=True,
    )


def _simulating_first(command_line, *, cores, instead_of_tpu, layout):
    @functools.wraps(command_line)
    def simulating_first(**kwargs):
        command = command_line(**kwargs)
        if "-c" not in command:  # a frozen executable: it runs no code we could add to
            return command
        program = command.index("-c") + 1
        command[program] = (
            f"import tpunb; tpunb.simulation.simulate(cores={cores}, "
            f"instead_of_tpu={instead_of_tpu}, layout={layout!r}); {command[program]}"
        )
        return command

    return simulating_first
