"""Where tpunb sees a rank's steps: for the duration of a launch, in the parent, each
``torch_xla.sync`` ends a step (for the hang watchdog's heartbeat and the step records,
through ``tpunb.upstream.step_hooks``, which leaves torch_xla's debug output naming the user's
line) and torch_xla's per-device loader is wrapped so that each batch it hands out is
recorded. The syncs torch_xla's dynamo bridge makes while it extracts a
``torch.compile``d graph (at a compiled function's first call, or a new shape) are
inside the notebook's step and end none. torch_xla's helpers that read device values
only after a sync (``xm.add_step_closure``'s closures, ``xm.rendezvous`` and
``xm.mesh_reduce`` through ``xm.xla_rendezvous``) have the CPU fallbacks they make
excused: they cut no graph. Reads of device values that cut the step or wait for the
device are recorded with their line (``reads.py``), and so are collective calls
(``watch/collective_calls.py``). The fork hands the hooks to the
ranks; the parent's own behaviour is unchanged (no rank runs in it) and restored
afterwards."""

import contextlib

from tpunb.launcher import heartbeat, process_counters, reads, recorder
from tpunb.upstream import registry, step_hooks
from tpunb.watch import collective_calls

# Its extract_graph_helper and extract_compiled_graph_helper call torch_xla.sync() to
# materialize the compiled graph's inputs.
_DYNAMO_BRIDGE = "torch_xla._dynamo.dynamo_bridge"


def _before_sync(caller):
    recording = recorder.current()
    if recording is not None and caller != _DYNAMO_BRIDGE:
        recording.before_sync()  # the steps before this one, computed by now: sent


def _after_sync(caller):
    if caller == _DYNAMO_BRIDGE:
        return
    heartbeat.tick()
    recording = recorder.current()
    if recording is not None:
        recording.end_step()


def _on_read(kind, what, file, line):
    recording = recorder.current()
    if recording is not None:
        recording.read(kind, what, file, line)


def _on_collective(name, args, kwargs, frame):
    recording = recorder.current()
    if recording is not None:
        recording.collective(name, args, kwargs, frame)


def _after_optimizer_step(optimizer, args, kwargs):
    recording = recorder.current()
    if recording is not None:
        recording.optimizer_stepped()


def recorded_batches(_, next_batch):
    """The registry's maker: the per-device loader's ``next``, recording each batch."""

    def next_batch_recorded(self):
        __tracebackhide__ = True  # a rank's traceback shows the program's loop, not this
        batch = next_batch(self)
        recording = recorder.current()
        if recording is not None:
            recording.batch(batch, self)
        return batch

    return next_batch_recorded


def excused(name, helper):
    """The registry's maker: a helper of xm whose reads of device values are excused."""
    if name == "add_step_closure":
        # A closure runs after the step's sync, on computed values: its .item() cuts
        # no graph.
        def add_excused_step_closure(closure, *args, **kwargs):
            return helper(process_counters.excusing(closure), *args, **kwargs)

        return add_excused_step_closure
    # xm.rendezvous and xm.mesh_reduce call it; it reads the gathered sizes after a sync.
    return process_counters.excusing(helper)


@contextlib.contextmanager
def installed(checked=True):
    """For the duration: every sync ends a step, every optimizer step is counted in it
    (torch.optim's global post-step hook) and, where torch_xla is as tpunb was
    checked against (``checked``), every batch the loader hands out is recorded and what
    torch_xla's helpers read after a sync is excused (neither a cut nor a step's
    compilation); what each watcher adds: ``reads_recorded``, ``collectives_recorded``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    syncs = registry.add_step_hooks(before=_before_sync, after=_after_sync)
    try:
        with contextlib.ExitStack() as patched:
            patched.callback(register_optimizer_step_post_hook(_after_optimizer_step).remove)
            if checked:
                patched.enter_context(registry.during("launch_batches"))
                patched.enter_context(registry.during("launch_excused_reads"))
            yield
    finally:
        step_hooks.remove(syncs)


def reads_recorded():
    """For the duration: reads of device values that cut a step or wait are recorded (the
    "reads" watcher's)."""
    return reads.watched(_on_read)


def collectives_recorded():
    """For the duration: each collective call is recorded in the ledger (the "collectives"
    watcher's)."""
    return collective_calls.recorded(_on_collective)
