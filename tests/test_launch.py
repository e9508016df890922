import contextlib
import gc
import os
import re
import signal
import threading
import time
import warnings

import pytest
import torch
from conftest import launch_leftovers, run_python

import tpunb
from tpunb.launcher.channel import Raised
from tpunb.launcher.failures import raised_error


def _identity(rank, tag, *, scale=1):
    import torch_xla.runtime as xr

    return {
        "rank": rank,
        "ordinal": xr.global_ordinal(),
        "world": xr.world_size(),
        "tag": tag,
        "scaled": rank * scale,
        "pid": os.getpid(),
    }


def test_every_rank_returns_in_rank_order(cores8, no_children_left):
    results = tpunb.launch(_identity, "hello", scale=10)
    assert [r["rank"] for r in results] == list(range(8))
    assert [r["ordinal"] for r in results] == list(range(8))
    assert {r["world"] for r in results} == {8}
    assert [r["scaled"] for r in results] == [10 * r for r in range(8)]
    assert {r["tag"] for r in results} == {"hello"}
    assert os.getpid() not in {r["pid"] for r in results}


def test_lambdas_and_closures_run_without_pickling(cores8):
    offset = 100
    counter = threading.Lock()  # unpicklable, captured by the closure

    def closure(rank):
        with counter:
            return rank + offset

    assert tpunb.launch(lambda rank: rank * 2) == [2 * r for r in range(8)]
    assert tpunb.launch(closure) == [100 + r for r in range(8)]


def _tensors(rank):
    import torch_xla

    device = torch_xla.device()
    weight = torch.nn.Parameter(torch.full((2,), float(rank), device=device))
    loss = (weight * 3).sum()  # not a leaf, requires grad
    return {
        "cpu": torch.arange(3) + rank,
        "xla": torch.ones(2, device=device) * rank,
        "parameter": weight,
        "loss": loss,
    }


def test_tensors_come_back_by_value_on_the_cpu(cores8):
    results = tpunb.launch(_tensors)  # the ranks' process is gone: nothing may refer to it
    for rank, result in enumerate(results):
        assert torch.equal(result["cpu"], torch.arange(3) + rank)
        assert result["xla"].device.type == "cpu"
        assert torch.equal(result["xla"], torch.ones(2) * rank)
        assert isinstance(result["parameter"], torch.nn.Parameter)
        assert result["loss"].item() == 6.0 * rank
    import sys

    assert not sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized()


def _fails_on_rank_3(rank):
    if rank == 3:
        raise ValueError("bad batch on rank 3")
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    # The others wait in a collective that rank 3 never joins.
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=torch_xla.device()))
    torch_xla.sync()
    return rank


def test_an_exception_in_rank_3_names_it_with_its_traceback(cores8, no_children_left):
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_fails_on_rank_3)
    error = caught.value
    assert error.ranks == (3,)
    assert str(error).startswith("rank 3 raised ValueError: bad batch on rank 3")
    assert "Traceback from rank 3" in str(error)
    assert 'raise ValueError("bad batch on rank 3")' in error.remote_traceback
    assert "_fails_on_rank_3" in error.remote_traceback


def test_ranks_stopped_by_the_failing_ranks_end_are_not_reported_as_failing():
    # How many of them reach the notebook before the launch is stopped is a race: in CI,
    # rank 2's RankEnded once arrived with rank 3's error, which then read (2, 3).
    failures = {
        3: Raised(3, "raised ValueError: bad batch on rank 3", "Traceback ...\n"),
        2: Raised(2, "raised RankEnded: rank 3 ended", "Traceback ...\n", consequence=True),
    }
    error = raised_error(failures)
    assert error.ranks == (3,)
    assert str(error).startswith("rank 3 raised ValueError") and "failed too" not in str(error)
    # Only ranks stopped by another's end: the report still names one.
    alone = raised_error({2: failures[2], 5: failures[2]._replace(rank=5)})
    assert alone.ranks == (2, 5)


def _dies_on_rank_5(rank, how):
    if rank == 5:
        if how == "SIGKILL":  # what the host's OOM killer sends
            os.kill(os.getpid(), signal.SIGKILL)
        else:  # a real segmentation fault: reading address 0
            import ctypes
            import faulthandler

            faulthandler.disable()  # pytest's, inherited: its dump would only clutter the log
            ctypes.string_at(0)
    time.sleep(30)


@pytest.mark.parametrize(
    "how, cause",
    [("SIGKILL", "most likely the host ran out of memory"), ("SIGSEGV", "a crash in native code")],
)
def test_a_rank_killed_by_a_signal_is_reported_with_the_likely_cause(
    cores8, no_children_left, how, cause
):
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_dies_on_rank_5, how)
    assert caught.value.signal == how
    # All 8: the others were stopped once rank 5 died.
    assert caught.value.ranks == tuple(range(8))
    # Its own process, or the one it shares with the ranks that had started by then.
    killed = "rank 5" if tpunb.machine.available().processes == 8 else r"ranks [\d, -]+"
    assert re.search(
        f"the process of {killed} \\(pid \\d+\\) was killed by {how}: {cause}", str(caught.value)
    )


def test_a_result_that_cannot_be_sent_back_names_the_rank_and_type(cores8):
    # Every rank fails: the report names the lowest of those whose error came first.
    with pytest.raises(tpunb.RankError, match=r"^rank \d returned a _thread.lock"):
        tpunb.launch(lambda rank: threading.Lock())


def test_launch_runs_again_after_a_failure(cores8, no_children_left):
    with pytest.raises(tpunb.RankError):
        tpunb.launch(_fails_on_rank_3)
    assert tpunb.launch(lambda rank: rank) == list(range(8))
    assert tpunb.launch(lambda rank: rank) == list(range(8))


def test_one_core_is_a_debug_mode_that_leaves_the_kernel_usable(cores8, no_children_left):
    import torch_xla

    (single,) = tpunb.launch(_identity, "one", cores=1)
    assert (single["rank"], single["world"]) == (0, 1)
    assert not torch_xla._XLAC._xla_runtime_is_initialized()
    assert len(tpunb.launch(_identity, "all")) == 8


@pytest.fixture
def forks():
    counts = {"forks": 0}
    os.register_at_fork(before=lambda: counts.__setitem__("forks", counts["forks"] + 1))
    yield counts


@pytest.mark.parametrize(
    "fn, args, kwargs, message",
    [
        (_identity, ("x",), {"start_method": "spawn"}, r"tpunb always forks"),
        (_identity, ("x",), {"cores": 3}, r"cores=3.*all 8 simulated cores or on 1"),
        (_identity, ("x",), {"cores": 0}, r"cores=0"),
        (_identity, (), {}, r"cannot be called as _identity\(rank, \*args, \*\*kwargs\)"),
        (lambda: 1, (), {}, r"The first parameter receives the core's rank"),
        ({"rank": 0}, (), {}, r"needs a function to run on every core, got dict"),
    ],
)
def test_bad_input_is_refused_before_any_fork(cores8, forks, fn, args, kwargs, message):
    with pytest.raises(tpunb.TpunbError, match=message):
        tpunb.launch(fn, *args, **kwargs)
    assert forks["forks"] == 0


def test_without_tpu_or_simulation_the_error_offers_simulate():
    result = run_python(
        """
        import tpunb
        try:
            tpunb.launch(print)
        except tpunb.TpunbError as error:
            print(error)
        """
    )
    assert "No TPU found" in result.stdout and "tpunb.simulate(cores=8)" in result.stdout


def test_a_parent_that_touched_the_device_is_refused_before_forking():
    result = run_python(
        """
        import os, tpunb, torch_xla
        forks = []
        os.register_at_fork(before=lambda: forks.append(1))
        tpunb.simulate(cores=8)
        torch_xla.device()
        try:
            tpunb.launch(print)
        except tpunb.TpunbError as error:
            print(len(forks), error)
        """
    )
    assert result.stdout.startswith("0 The XLA runtime is already running"), result.stderr
    assert "torch_xla.device()" in result.stdout and "Start a new Python process" in result.stdout


def _spawn_variables(rank):
    return os.environ.get("TPU_PROCESS_ADDRESSES"), os.environ.get("CLOUD_TPU_TASK_ID")


def test_kaggle_presets_are_removed_for_the_launch_and_restored(cores8, monkeypatch):
    monkeypatch.setenv("TPU_PROCESS_ADDRESSES", "local")
    monkeypatch.setenv("CLOUD_TPU_TASK_ID", "0")
    # In the ranks, torch_xla's own topology (tpu.configure_topology): a port and a task a
    # process.
    processes = tpunb.machine.available().processes
    addresses = ",".join(f"localhost:{8476 + p}" for p in range(processes))
    expected = {(addresses, str(rank * processes // 8)) for rank in range(8)}
    assert set(tpunb.launch(_spawn_variables)) == expected
    assert os.environ["TPU_PROCESS_ADDRESSES"] == "local"
    assert os.environ["CLOUD_TPU_TASK_ID"] == "0"


def test_interrupting_the_kernel_stops_every_rank_and_the_next_launch_works():
    result = run_python(
        f"""
        import os, signal, sys, threading, time
        import tpunb
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import launch_leftovers

        tpunb.simulate(cores=8)

        def forever(rank):
            while True:
                time.sleep(0.1)

        threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            tpunb.launch(forever)
        except KeyboardInterrupt:
            print("interrupted", launch_leftovers())
        print(tpunb.launch(lambda rank: rank))
        """
    )
    assert result.stdout.splitlines() == ["interrupted []", str(list(range(8)))], result.stderr


def _skips_a_collective(rank, blocks):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    for step in range(3):
        if rank == 3 and step == 1:
            if blocks:
                time.sleep(600)  # a rank blocked forever
            return rank  # the classic mismatch: skips the collective the others enter
        xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=device))
        torch_xla.sync()
    return rank


_LINE = _skips_a_collective.__code__.co_firstlineno + 11  # its all_reduce


def test_a_hang_is_reported_with_steps_and_stacks_then_stopped(cores8, no_children_left):
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_skips_a_collective, True, hang_timeout=2)
    error = caught.value
    others = [r for r in range(8) if r != 3]
    assert "No rank finished a step for 2 s (hang_timeout=2)" in str(error)
    assert "ranks 0-2, 4-7: after step 1, waiting in a collective" in str(error)
    assert (  # the launch's ledger of collective calls (tpunb/launcher/ledger.py)
        "Some ranks made more collective calls than others, and wait for the others to make "
        "them:\n  ranks 0-2, 4-7: 2 collective calls, the last all_reduce('sum', float32[1]) "
        f"at {__file__}, line {_LINE}, in step 2\n  rank 3: 1 collective call" in str(error)
    )
    assert error.ranks == tuple(range(8))
    assert "rank 3: after step 1, in File" in str(error) and "in _skips_a_collective" in str(error)
    assert "time.sleep(600)" not in error.stacks[3]  # faulthandler gives lines, not source
    assert "_skips_a_collective" in error.stacks[3]
    assert all("tpunb/simulation/host_exchange.py" in error.stacks[r] for r in others)


def test_a_rank_that_ends_before_a_collective_stops_the_others_at_once(cores8, no_children_left):
    # On a TPU the others would wait for rank 3 forever: the launch's ledger of collective
    # calls sees that rank 3 returned without the call they made (the simulation raises
    # RankEnded in the others at once, which the ledger's report replaces).
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_skips_a_collective, False, hang_timeout=60)
    assert str(caught.value).startswith(
        "The ranks took different paths: at their collective call number 2 they made "
        "different calls, so they can never meet (on a TPU they would wait for each other "
        "forever):\n  ranks 0-2, 4-7: all_reduce('sum', float32[1]) at "
        f"{__file__}, line {_LINE}, in step 2\n  rank 3: made none: returned after 1 "
        "collective call\n"
    )
    assert caught.value.ranks == (3,)


def _fails_before_a_collective(rank):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    if rank == 5:
        raise ValueError("rank 5 has no data")
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=torch_xla.device()))


def test_the_rank_that_raised_is_reported_not_the_ranks_it_stopped(cores8, no_children_left):
    with pytest.raises(tpunb.RankError, match=r"^rank 5 raised ValueError: rank 5 has no data"):
        tpunb.launch(_fails_before_a_collective, hang_timeout=60)


def test_hang_timeout_must_be_positive_seconds_or_none(cores8):
    with pytest.raises(tpunb.TpunbError, match=r"hang_timeout=0\)"):
        tpunb.launch(_identity, "x", hang_timeout=0)
    assert len(tpunb.launch(_identity, "x", hang_timeout=None)) == 8


def _sums(rank, loader):
    return sum(float(batch[0].sum()) for batch in loader)


def test_a_dataloader_with_worker_processes_is_warned_about_before_forking(cores8, forks):
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)  # the warning, raised, stops it
        with pytest.raises(tpunb.TpunbWarning, match=r"num_workers=2 .* 8 ranks .* \(16 in all"):
            tpunb.launch(_sums, loader)
    assert forks["forks"] == 0
    # Warned, not refused: it works, at a cost.
    with pytest.warns(tpunb.TpunbWarning):
        assert tpunb.launch(_sums, loader) == [2016.0] * 8


def test_a_dataloader_whose_workers_the_host_has_cpus_for_is_not_warned_about(cores8):
    from torch.utils.data import DataLoader, TensorDataset

    from tpunb.launcher import preflight

    # One rank in a process of its own, one worker: as torch_xla's own examples run them.
    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=8, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        plan = preflight.checked(1, hang_timeout=600, view=False, fn=_sums, args=(loader,))
    assert plan.cores == 1


def _open_descriptors():
    """{descriptor: what it is} of this process."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def test_twenty_launches_leave_no_process_no_descriptor_and_little_memory(cores8, no_children_left):
    import psutil

    tpunb.launch(lambda rank: rank)  # warm-up: imports, first allocations
    gc.collect()  # what earlier tests left for the collector; tpunb's own must not need it
    descriptors, memory = _open_descriptors(), psutil.Process().memory_info().rss
    for launch in range(20):
        if launch % 5 == 4:  # failed launches clean up too
            with pytest.raises(tpunb.RankError):
                tpunb.launch(_fails_on_rank_3)
        else:
            assert tpunb.launch(lambda rank: torch.ones(1000) * rank)[7][0] == 7
    assert launch_leftovers() == []
    assert _open_descriptors() == descriptors
    growth = psutil.Process().memory_info().rss - memory
    print(f"20 launches: {len(descriptors)} descriptors, rss +{growth / 2**20:.1f} MiB")
    assert growth < 20 * 2**20
    assert [t.name for t in threading.enumerate() if t.name.startswith("tpunb")] == []
