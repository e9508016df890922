"""Where tpunb sees a rank's steps: for the duration of a launch, in the parent,
``torch_xla.sync`` and torch_xla's per-device loader are wrapped so that each sync ends a
step (for the hang watchdog's heartbeat and the step records) and each batch a loader
hands out is recorded. The fork hands the wrappers to the ranks; the parent's own
behaviour is unchanged (no rank runs in it) and restored afterwards."""

import contextlib

from tpunb.launcher import heartbeat, recorder


@contextlib.contextmanager
def installed():
    import torch_xla
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.torch_xla as torch_xla_module

    sync = torch_xla.sync
    next_batch = pl.PerDeviceLoader.next

    def sync_ending_a_step(*args, **kwargs):
        result = sync(*args, **kwargs)
        heartbeat.tick()
        steps = recorder.current()
        if steps is not None:
            steps.end_step()
        return result

    def next_recorded(self):
        batch = next_batch(self)
        steps = recorder.current()
        if steps is not None:
            steps.batch(batch, self)
        return batch

    # torch_xla.compile and the loaders call the module's sync, user code the package's.
    torch_xla.sync = torch_xla_module.sync = sync_ending_a_step
    pl.PerDeviceLoader.next = next_recorded
    try:
        yield
    finally:
        torch_xla.sync = torch_xla_module.sync = sync
        pl.PerDeviceLoader.next = next_batch
