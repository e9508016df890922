"""The hooked ``torch_xla.sync``: rebuilt from the installed body where it is the one the
rebuild knows, the hooks around it where it is not (another torch_xla release)."""

from conftest import run_python

from tpunb.upstream import step_hooks


def test_a_sync_body_it_does_not_know_gets_every_hook_around_the_whole_call():
    events = []

    def another_release_sync(wait=False):  # reaches the step marker some other way
        events.append(("sync", wait))

    assert not step_hooks.knows(another_release_sync)
    handle = step_hooks.add(
        before=lambda caller: events.append(("before", caller)),
        dispatched=lambda caller: events.append(("dispatched", caller)),
        after=lambda caller: events.append(("after", caller)),
    )
    try:
        step_hooks.hooked("sync", another_release_sync)(wait=True)
    finally:
        step_hooks.remove(handle)
    assert events == [
        ("before", __name__),
        ("sync", True),
        ("dispatched", __name__),
        ("after", __name__),
    ]


def test_a_body_with_the_hooked_calls_out_of_order_is_not_rebuilt():
    def reordered(xm, runtime):
        runtime._set_all_reduce_token(None, None)
        runtime._xla_get_default_device()
        xm.is_master_ordinal()

    assert not step_hooks.knows(reordered)
    assert step_hooks.hooked("sync", reordered).__wrapped__ is reordered


def test_the_installed_sync_runs_the_step_with_each_hook_in_order():
    # Called for real (a process of its own: the runtime starts there): the hooks run
    # around the step marker, in order, named after the module that called sync, and the
    # step's work is done.
    result = run_python(
        """
        import torch, torch_xla, torch_xla.debug.metrics as met
        import torch_xla.core.xla_model as xm
        from tpunb.upstream import registry, step_hooks

        events = []

        def before(caller):  # the step's computation not executed yet
            events.append(("before", caller, met.counter_value("ExecuteComputation")))

        registry.add_step_hooks(
            before=before,
            dispatched=lambda caller: events.append(("dispatched", caller)),
            after=lambda caller: events.append(("after", caller)),
        )
        x = torch.ones(3, device=torch_xla.device()) * 2
        torch_xla.sync()
        xm.wait_device_ops()  # the step has run: sync returns before it has
        torch_xla.sync(wait=True)
        print(events)
        print(met.counter_value("ExecuteComputation"), x.cpu().tolist())
        """
    )
    events, executed = result.stdout.splitlines()[-2:]
    assert events == (
        "[('before', '__main__', None), ('dispatched', '__main__'), ('after', '__main__'), "
        "('before', '__main__', 1), ('dispatched', '__main__'), ('after', '__main__')]"
    ), result.stderr[-3000:]
    assert executed == "1 [2.0, 2.0, 2.0]"


def test_a_launch_whose_sync_is_another_body_ends_every_step_without_a_false_hang():
    # Another release's torch_xla.sync, which the rebuild does not know: the hooks go around
    # it, every step still ends (the watchdog sees progress), with a short hang_timeout.
    result = run_python(
        """
        import time, torch, torch_xla, tpunb

        upstream_sync = torch_xla.sync

        def sync(wait=False, reset_scope=True):  # its own body: calls the marker elsewhere
            return upstream_sync(wait=wait, reset_scope=reset_scope)

        torch_xla.sync = torch_xla.torch_xla.sync = sync
        tpunb.simulate(cores=2)

        def train(rank):
            total = torch.zeros(2, device=torch_xla.device())
            for _ in range(20):
                total = total + 1
                torch_xla.sync()
                time.sleep(0.4)  # 8 s of steps, longer than the hang_timeout
            return total.tolist()

        # 6 s: a rank's start (its runtime, the first compilation) takes far less, even on a
        # busy machine; a sync the hooks missed would be stopped as a hang.
        results = tpunb.launch(train, hang_timeout=6, live=False)
        print(list(results), [len(steps) for steps in results.history.steps.values()])
        """,
        timeout=300,
    )
    assert result.stdout.splitlines()[-1] == "[[20.0, 20.0], [20.0, 20.0]] [20, 20]", (
        result.stdout[-2000:] + result.stderr[-3000:]
    )
