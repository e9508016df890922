"""The simulation in the processes that the ``spawn`` start method creates.

Used only under ``tpunb.simulate``. ``xmp.spawn`` and ``torch_xla.launch`` start their
processes with ``spawn`` unless told otherwise. A spawned child is a new Python: it reads
``PJRT_DEVICE`` and ``CPU_NUM_DEVICES`` from the environment it inherits, but none of the
simulation's patches. So the command line that starts it (``multiprocessing.spawn.
get_command_line``) first simulates the same cores in it, then runs multiprocessing's
own start-up. Its children get the simulation the same way.
"""

import dataclasses
import functools

from tpunb import machine


def command_line_simulating(_, command_line):
    """The registry's maker for ``multiprocessing.spawn.get_command_line``."""

    @functools.wraps(command_line)
    def command_simulating_first(**kwargs):
        command = command_line(**kwargs)
        if "-c" not in command:  # a frozen executable: it runs no code we could add to
            return command
        program = command.index("-c") + 1
        simulated = dataclasses.asdict(machine.simulation())
        arguments = ", ".join(f"{name}={value!r}" for name, value in simulated.items())
        command[program] = (
            f"import tpunb; tpunb.simulation.simulate({arguments}); {command[program]}"
        )
        return command

    return command_simulating_first
