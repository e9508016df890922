"""The ranks that torchrun starts: ``torchrun --nproc-per-node=N -m tpunb.simulate script.py``.

On a TPU host, ``torchrun --nproc-per-node=8 script.py`` starts the 8 processes itself, one a
chip, each running the whole script; in each, ``torch_xla.launch`` calls the function at
once, and ``dist.init_process_group("xla", init_method="xla://")`` takes the rank from the
variables torchrun sets. Here each of those processes runs ``tpunb.simulate`` first
(``python -m tpunb.simulate``), which makes it one rank process of the simulation, as
``xmp.spawn``'s processes are (rank_processes.py): its runtime gets one CPU device, its
world size and ordinal are set, and it joins the meeting the ranks' collectives use
(host_exchange.py). Local rank 0 opens the meeting and names it in a small file the others
wait for, keyed by the torchrun agent that started them all (their parent process). Each
rank says it ended as it exits, with its exception if one ended it; local rank 0 closes the
meeting once every rank has ended.
"""

import atexit
import contextlib
import os
import tempfile
import time

from tpunb.errors import TpunbError
from tpunb.upstream import registry

_WAIT = 120  # seconds a rank waits for local rank 0 to open the meeting


def launched():
    """Whether torchrun (torch's elastic launcher) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def become_rank(cores):
    """Makes this process the rank torchrun says it is, of ``cores`` simulated cores."""
    from tpunb.simulation import host_collectives, host_exchange, rank_processes

    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    world = int(os.environ.get("WORLD_SIZE", local_world))
    if local_world != cores or world != local_world:
        raise TpunbError(
            f"torchrun started {local_world} processes on this host ({world} in all) for "
            f"{cores} simulated cores: the simulation is one host with a process a core. "
            f"Start it with torchrun --nnodes=1 --nproc-per-node={cores} -m tpunb.simulate "
            f"--cores {cores} script.py."
        )
    meeting = host_exchange.Meeting(local_world) if local_rank == 0 else None
    path = os.path.join(
        tempfile.gettempdir(),
        f"tpunb-torchrun-{os.getppid()}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
    )
    if meeting is not None:
        with open(path + ".new", "w") as named:
            named.write(meeting.address)
        os.replace(path + ".new", path)
    exchange = rank_processes.become_rank(local_rank, local_world, _address(path))
    exchange.join()
    recorded = contextlib.ExitStack()  # the script's collective calls, until the rank ends
    recorded.enter_context(host_collectives.calls_recorded())
    error = {}  # the exception that ends the rank's program, if one does
    registry.install("torchrun_error_kept", error)
    atexit.register(_end, exchange, meeting, path, error, recorded)


def _address(path):
    deadline = time.monotonic() + _WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TpunbError(
                f"Local rank 0 did not open the simulation's meeting within {_WAIT} s ({path} "
                "was not written): did it fail at its start? Its output says why."
            )
        time.sleep(0.05)
    with open(path) as named:
        return named.read()


def excepthook_keeping_error(_, excepthook, kept):
    """The registry's maker for ``sys.excepthook``: the rank's error kept in ``kept`` for
    its end."""

    def keeping_the_error(kind, error, traceback):
        kept["error"] = error
        excepthook(kind, error, traceback)

    return keeping_the_error


def _end(exchange, meeting, path, error, recorded):
    from tpunb.simulation import host_collectives

    recorded.close()
    exchange.end(error.get("error"))
    host_collectives.start(None)
    exchange.close()
    if meeting is None:
        return
    while not meeting.all_ended():  # the others may still read this rank's last round
        time.sleep(0.05)
    meeting.close()
    os.unlink(path)
