"""The hooked ``torch_xla.sync``: rebuilt from the installed body where it is the one the
rebuild knows, the hooks around it where it is not (another torch_xla release)."""

import torch_xla

from tpunb.upstream import patching, step_hooks


def test_the_installed_sync_is_rebuilt_from_its_own_body():
    upstream = patching.upstream(torch_xla.sync)
    assert step_hooks.knows(upstream)
    rebuilt = step_hooks.hooked("sync", upstream)
    assert rebuilt.__code__ is upstream.__code__  # its frames: torch_xla's own file and lines


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
