"""The threads torch_xla starts for a process's ranks: what the simulation does as they
start and as each one ends.

Used only under ``tpunb.simulate``. torch_xla runs the ranks of a process as threads
(``_run_thread_per_device`` in ``torch_xla/_internal/pjrt.py``; on the simulation all of
them). As they start, the collectives' meeting place is made new for them, and the
runtime about to start is told to use the CPU (tpu_answers.py). As a rank ends,
returning or raising, it gives back torch's random generator (random_state.py) and says
so to the collectives: the ranks waiting for it at a collective stop at once with
``RankEnded``, naming it, and the ranks that call one later stop as they call it. On a TPU
they would wait for it forever. ``xmp.spawn`` then raises the exception of the rank that
ended first, as if it had been the only one.
"""

import functools

from tpunb.errors import RankEnded
from tpunb.simulation import collectives, random_state, rank_cpu, tpu_answers


def telling_the_collectives(_, run_threads):
    """The registry's maker for ``_run_thread_per_device`` on the thread layout."""

    # Keeps the name: xmp.spawn sends it to its processes by name.
    @functools.wraps(run_threads)
    def run_thread_per_device(local_rank, local_world_size, fn, initializer_fn):
        @functools.wraps(fn)
        def rank():
            rank_cpu.rank_started()
            try:
                result = fn()
            except BaseException as error:
                collectives.rank_ended(error)
                raise
            finally:
                random_state.done_drawing()
            collectives.rank_ended(None)
            return result

        collectives.new_meeting_place()
        tpu_answers.runtime_reads_cpu()  # the runtime starts in this process: on the CPU
        try:
            return run_threads(local_rank, local_world_size, rank, initializer_fn)
        except RankEnded as stopped:
            # torch_xla raises the lowest rank's exception: the cause is the ended rank's.
            if stopped.cause is None:
                raise
            raise stopped.cause from None

    return run_thread_per_device
