"""Where tpunb sees a rank's steps: for the duration of a launch, in the parent,
``torch_xla.sync`` and torch_xla's per-device loader are wrapped so that each sync ends a
step (for the hang watchdog's heartbeat and the step records) and each batch a loader
hands out is recorded. The syncs torch_xla's dynamo bridge makes while it extracts a
``torch.compile``d graph (at a compiled function's first call, or a new shape) are inside
the notebook's step and end none. torch_xla's helpers that read device values only after
a sync (``xm.add_step_closure``'s closures, ``xm.rendezvous`` and ``xm.mesh_reduce``
through ``xm.xla_rendezvous``) have the CPU fallbacks they make excused: they cut no
graph. The fork hands the wrappers to the ranks; the parent's own behaviour is unchanged
(no rank runs in it) and restored afterwards."""

import contextlib
import sys

from tpunb.launcher import heartbeat, recorder

# Its extract_graph_helper and extract_compiled_graph_helper call torch_xla.sync() to
# materialize the compiled graph's inputs.
_DYNAMO_BRIDGE = "torch_xla._dynamo.dynamo_bridge"


@contextlib.contextmanager
def installed():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.torch_xla as torch_xla_module

    sync = torch_xla.sync
    next_batch = pl.PerDeviceLoader.next
    add_step_closure = xm.add_step_closure
    xla_rendezvous = xm.xla_rendezvous

    def sync_ending_a_step(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == _DYNAMO_BRIDGE:
            return sync(*args, **kwargs)
        steps = recorder.current()
        if steps is not None:
            steps.before_sync()  # the steps before this one, computed by now: sent
        result = sync(*args, **kwargs)
        heartbeat.tick()
        if steps is not None:
            steps.end_step()
        return result

    def next_recorded(self):
        batch = next_batch(self)
        steps = recorder.current()
        if steps is not None:
            steps.batch(batch, self)
        return batch

    def add_excused_step_closure(closure, *args, **kwargs):
        # A closure runs after the step's sync, on computed values: its .item() cuts no graph.
        return add_step_closure(recorder.excusing_fallbacks(closure), *args, **kwargs)

    # torch_xla.compile and the loaders call the module's sync, user code the package's.
    torch_xla.sync = torch_xla_module.sync = sync_ending_a_step
    pl.PerDeviceLoader.next = next_recorded
    xm.add_step_closure = add_excused_step_closure
    # xm.rendezvous and xm.mesh_reduce call it; it reads the gathered sizes after a sync.
    xm.xla_rendezvous = recorder.excusing_fallbacks(xla_rendezvous)
    try:
        yield
    finally:
        torch_xla.sync = torch_xla_module.sync = sync
        pl.PerDeviceLoader.next = next_batch
        xm.add_step_closure = add_step_closure
        xm.xla_rendezvous = xla_rendezvous
