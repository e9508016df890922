"""The notebook's side of a launch, fed the records ranks send, without a rank: through the
launch's channel (a real pipe), the supervisor, the history, the compile watch and the
text view. Fast: no rank runs, no torch_xla graph is built."""

import pickle
import warnings

import pytest

import tpunb
from tpunb.launcher import launchers, rank, supervisor
from tpunb.launcher.channel import Raised, Returned, Steps
from tpunb.launcher.preflight import Plan
from tpunb.watch import live
from tpunb.watch.history import Step
from tpunb.watch.live import Snapshot

STEPS = 10  # a rank's steps; its batches have 8 samples, its last one 5
COMPILES = [2, 1, 0, 0, 0, 0, 0, 0, 0, 1]  # each rank's process: the warm-up, then the 5


def _records(core):
    """Core ``core``'s step records, as a rank of the process layout sends them."""
    return [
        Step(
            step,
            time=0.1 * step,
            values={"loss": 1.0 / (step + 1) + core},
            shapes=[[(5 if step == STEPS - 1 else 8, 16)]],
            samples=5 if step == STEPS - 1 else 8,
            compiles=COMPILES[step],
            cached=0,
            compile_seconds=0.5 * COMPILES[step],
            fallbacks={},
            epoch=0,
            epoch_batch=step + 1,
            epoch_batches=STEPS,
        )
        for step in range(STEPS)
    ]


class _Records(launchers.Launcher):
    """Ranks that are only what they send: each core's step records, in two messages as a
    rank sends them while it runs, then its error or its result, written to the launch's
    channel from the launcher's thread."""

    def __init__(self, cores, failing=None):
        super().__init__(cores)
        self.failing = failing

    def start(self, key):
        job = rank.registered(key)
        for core in range(self.cores):
            records = _records(core)
            job.channel.send(Steps.of(core, records[:4]), plain=True)
            job.channel.send(Steps.of(core, records[4:]), plain=True)
        for core in range(self.cores):
            if core == self.failing:
                job.channel.send(Raised(core, "raised ValueError: no more data", "Traceback"))
            else:
                job.channel.send(Returned([(core, pickle.dumps(core * 10))]))


def _supervise(launcher, unwatched=frozenset()):
    plan = Plan(launcher.cores, True, hang_timeout=None, view="text", unwatched=unwatched)
    return supervisor.supervise(plan, launcher)


def test_records_reach_the_history_the_compile_watch_and_the_view(capsys, monkeypatch):
    unjudged_at_close = []  # steps with compilations the final figure would draw unjudged

    def close(view, failed):
        compiled = {s.step for steps in view.history.steps.values() for s in steps if s.compiles}
        unjudged_at_close.extend(sorted(compiled - set(view.history.verdicts)))
        return text_close(view, failed)

    text_close = live.TextView.close
    monkeypatch.setattr(live.TextView, "close", close)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        results = _supervise(_Records(2))
    assert unjudged_at_close == []
    assert list(results) == [0, 10]
    history = results.history
    for core in range(2):
        steps, losses = history.values("loss")[core]
        assert losses == [r.values["loss"] for r in _records(core)]
    # Each process compiled the short last batch's graph: named once, as its cause.
    [message] = [str(w.message) for w in warned if issubclass(w.category, tpunb.TpunbWarning)]
    assert message.startswith(
        "epoch 1, batch 10 compiled 1 new graph: batch shape (5, 16) is smaller than the usual "
        "batch of 8"
    )
    summary = results.compiles
    assert (summary.compiles, summary.compiles_after_warmup, summary.steps) == (4, 1, STEPS)
    assert (summary.processes, summary.all_processes_compiles) == (2, 8)
    # The figure draws the watch's verdicts: the warm-up's 3, the 1 after it at the 10th
    # training step (the figure counts training steps from 1).
    per_step = history.compiles_per_step()
    assert sum(at.warmup for at in per_step) == summary.warmup_compiles == 3
    assert [at.step for at in per_step if at.compiles > at.warmup] == [STEPS]
    # The text view: a line at the epoch's end and one at the launch's, the loss the mean
    # of the cores' last (0.1 and 1.1), the rate the run's: 2 x 77 samples in 0.9 s.
    epoch, done = capsys.readouterr().out.splitlines()
    assert epoch == f"epoch 1: {STEPS} batches a core, loss 0.6"
    assert done.startswith(f"done: epoch 1, batch {STEPS}/{STEPS}, loss 0.6, ")
    assert done.endswith(", 171 samples/s over the run, 4 compilations, 0 s elapsed")
    # While it runs, the line's rate is a trailing mean, and says over how many steps.
    [rate] = [part for part in Snapshot.of(history, 4, 0.5).parts() if "samples/s" in part]
    current = history.current_samples_per_second()
    assert rate == f"{current:,.0f} samples/s over the last {history.rate_over} steps"


def test_a_ranks_error_is_the_launchs_outcome_with_the_rank_named():
    with pytest.raises(tpunb.RankError, match="no more data") as raised:
        _supervise(_Records(2, failing=1))
    assert raised.value.ranks == (1,)
    assert "rank 1" in str(raised.value)


class _Looking(_Records):
    """Also notes which watchers the ranks would run, and which of their hooks they find."""

    def start(self, key):
        import torch
        import torch_xla.core.xla_model as xm

        from tpunb.upstream import patching

        self.seen = (
            rank.registered(key).plan.unwatched,
            "launch_reads" in patching.patches(torch.Tensor.item),
            "collective_ledger" in patching.patches(xm.all_reduce),
        )
        super().start(key)


def test_each_watcher_can_be_left_out_by_name():
    from tpunb.launcher import watchers

    every = _Looking(2)
    with warnings.catch_warnings(record=True):
        watched = _supervise(every)
    assert every.seen == (frozenset(), True, True)
    assert watched.compiles.compiles == 4
    none = _Looking(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)  # the short batch's goes too
        unwatched = _supervise(none, unwatched=frozenset(watchers.NAMES))
    assert none.seen == (frozenset(watchers.NAMES), False, False)
    assert list(unwatched) == [0, 10] and unwatched.compiles.compiles == 0
    assert unwatched.history.values("loss") == watched.history.values("loss")


class _SlowToEnd(_Records):
    """A rank fails, and the launcher takes three of the supervisor's stops to end, as
    processes do that take a moment to die."""

    def __init__(self, cores, kills):
        super().__init__(cores, failing=0)
        self.kills = kills

    def start(self, key):
        super().start(key)
        self.kills.wait(timeout=120)  # a fence: the supervisor stops it long before


def test_while_stopping_the_supervisor_looks_for_processes_to_kill_once_a_check(monkeypatch):
    # It spun: once stopping, its loop no longer waited for the inbox and rescanned /proc
    # for processes to kill on every turn, thousands of times a second.
    import threading
    import time

    calls, kills = [], threading.Event()

    def kill_trees(pids):
        calls.append(time.monotonic())
        if len(calls) == 3:
            kills.set()

    monkeypatch.setattr(supervisor.processes, "kill_trees", kill_trees)
    with pytest.raises(tpunb.RankError, match="no more data"):
        _supervise(_SlowToEnd(2, kills))
    gaps = [later - earlier for earlier, later in zip(calls, calls[1:], strict=False)]
    # A check's wait between two looks (a busy machine only makes them longer).
    assert len(gaps) >= 2 and min(gaps) >= supervisor.HANG_CHECK_SECONDS / 2, gaps


def test_a_watcher_named_wrong_is_an_error_not_a_watcher_silently_off():
    with pytest.raises(ValueError, match=r"no watchers called \['compile'\]"):
        Plan(2, True, unwatched=frozenset({"compile"}))
    with pytest.raises(ValueError, match="no watcher called 'memroy'"):
        Plan(2, True).watches("memroy")
    assert Plan(2, True, unwatched=frozenset({"memory"})).watches("compiles")


def test_the_supervisor_sees_a_rank_process_end_without_reaping_it():
    # It read process.exitcode, which reaps. The thread of xmp.spawn's ProcessPoolExecutor,
    # blocked in that process's join, then got ECHILD: its join returned without the exit
    # code and left the process, and two pipes, in multiprocessing's set of children
    # (cpython #130895); one launch in ten left them so on this machine.
    import multiprocessing
    import os
    import time

    from tpunb.launcher import processes

    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(3,))
    process.start()
    deadline = time.monotonic() + 120  # a fence: it ends at once
    while not processes.ended(process):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Still a zombie, for its joiner to reap.
    assert os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    process.join()
    assert process.exitcode == 3
    assert process not in multiprocessing.process._children
