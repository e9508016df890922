"""What starts the ranks of a launch: one small interface, one file a mechanism
(``xmp_spawn.py``: every core; ``one_core.py``: one rank in a child process; tpunb.lightning:
Lightning's own XLA launcher)."""

from __future__ import annotations

import abc


class Launcher(abc.ABC):
    """Starts ``cores`` ranks, each of which calls ``tpunb.launcher.rank.run(key, rank)``,
    and returns once all of them have ended. ``start`` runs in a background thread of the
    notebook's process: it may block; the supervisor watches the ranks meanwhile."""

    def __init__(self, cores: int) -> None:
        self.cores = cores

    @abc.abstractmethod
    def start(self, key: int) -> None:
        """Starts the ranks of the job ``key`` and waits for them."""
