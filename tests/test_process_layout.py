"""One process a simulated core (``tpunb.simulate``): each
rank sees what a rank of a TPU v5e-8 sees, its state is its process's own, and a launch
that fails leaves no process and no shared memory behind."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import launch_leftovers, run_python

import tpunb
from tpunb.errors import CollectiveMismatch

SHARED_MEMORY = "/dev/shm"


def _what_a_rank_sees(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    device = torch_xla.device()
    drawn = torch.rand(1).item()  # the generator: a copy of the notebook's
    for _ in range(rank + 1):
        torch.tensor([1.0], device=device).add(1).item()  # this process's own counters
    return {
        "pid": os.getpid(),
        "device": str(device),
        "devices": xm.get_xla_supported_devices(),
        "answers": (
            xr.world_size(),
            xr.global_ordinal(),
            xr.local_ordinal(),
            xr.process_index(),
            xr.process_count(),
            xr.addressable_device_count(),
            xr.global_device_count(),
            xm.xla_device_hw(device),
        ),
        "drawn": drawn,
        "reads": met.counter_value("aten::_local_scalar_dense"),
    }


def test_each_rank_is_a_process_that_sees_what_a_v5e_8_rank_sees(cores8):
    torch.manual_seed(11)
    expected = torch.rand(1).item()
    torch.manual_seed(11)
    results = tpunb.launch(_what_a_rank_sees, live=False)
    assert len({r["pid"] for r in results}) == 8 and os.getpid() not in {r["pid"] for r in results}
    for rank, seen in enumerate(results):
        assert seen["device"] == "xla:0" and seen["devices"] == ["xla:0"]
        assert seen["answers"] == (8, rank, rank, rank, 8, 1, 8, "TPU")
        assert seen["drawn"] == expected  # every rank draws what the notebook would next
        assert seen["reads"] == rank + 1  # its own .item()s, no other rank's
    assert tpunb.env().layout.describe() == "8 processes x 1 thread"


def _stops(rank, how):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device))
    if rank == 2:
        if how == "raises":
            raise ValueError("rank 2 broke")
        if how == "is killed":
            os.kill(os.getpid(), signal.SIGKILL)
        return "returned early"
    return xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device)).tolist()


@pytest.mark.parametrize(
    "how, error, message",
    [
        ("raises", ValueError, "rank 2 broke"),
        # The others wait for it, as on a TPU, and the judge of their calls names why.
        ("returns", CollectiveMismatch, "rank 2: made none: returned after 1 collective call"),
        # The launching process tells the others, or the pool sees its process die first.
        ("is killed", Exception, "it was killed: its process exited|terminated abruptly"),
    ],
)
def test_a_rank_that_ends_stops_a_plain_xmp_spawn_and_leaves_nothing(cores8, how, error, message):
    import torch_xla.distributed.xla_multiprocessing as xmp

    segments = set(os.listdir(SHARED_MEMORY))
    with pytest.raises(error, match=message):
        xmp.spawn(_stops, args=(how,), start_method="fork")
    assert set(os.listdir(SHARED_MEMORY)) == segments
    assert launch_leftovers() == []


def _ends_early(rank, fails):
    import torch_xla
    import torch_xla.core.xla_model as xm

    if fails and rank == 5:
        raise RuntimeError("rank 5 gave up")
    return xm.all_reduce(xm.REDUCE_SUM, torch.ones(1, device=torch_xla.device())).item()


def test_twenty_launches_failed_ones_among_them_leave_nothing_behind(cores8):
    segments = set(os.listdir(SHARED_MEMORY))
    for launch in range(20):
        fails = launch % 4 == 3
        if fails:
            with pytest.raises(tpunb.RankError, match="rank 5 raised RuntimeError: rank 5 gave up"):
                tpunb.launch(_ends_early, fails, live=False)
        else:
            assert list(tpunb.launch(_ends_early, fails, live=False)) == [8.0] * 8
        assert launch_leftovers() == []
    assert set(os.listdir(SHARED_MEMORY)) == segments


def test_a_layout_or_the_layout_variable_is_refused_with_why(monkeypatch):
    # The threads layout is retired: asking for a layout is refused, never ignored.
    monkeypatch.delenv("TPUNB_SIMULATION_LAYOUT", raising=False)
    why = "a process a core, as on Kaggle's TPU v5e-8 .*threads layout.* is retired"
    for layout in ("threads", "processes"):
        with pytest.raises(tpunb.TpunbError, match=rf"layout='{layout}'\): .*{why}.*leave layout="):
            tpunb.simulate(cores=8, layout=layout)
    monkeypatch.setenv("TPUNB_SIMULATION_LAYOUT", "threads")
    with pytest.raises(tpunb.TpunbError, match=f"LAYOUT='threads': .*{why}.*unset TPUNB_SIM"):
        tpunb.simulate(cores=8)


def test_simulate_after_importing_tpunb_simulate_takes_simulates_arguments():
    # ``import tpunb.simulate`` makes the command line's module tpunb.simulate: calling it
    # still takes every argument of simulate() (it dropped layout=, a TypeError). In a
    # process of its own: the import replaces tpunb.simulate for the whole process.
    result = run_python(
        """
        import tpunb, tpunb.simulate
        try:
            tpunb.simulate(cores=8, layout="threads")
        except tpunb.TpunbError as error:
            print("refused:", error)
        """
    )
    assert result.stdout.startswith("refused: simulate(layout='threads'): "), result.stderr


@pytest.mark.pair("colab", reason="on Kaggle's, the process layout's debug-output test sees it")
def test_ranks_that_end_at_once_still_each_run_in_a_process_of_their_own(tmp_path):
    # xmp.spawn's process pool gives a rank's task to any idle process: without the ranks
    # meeting at their start (as a TPU's runtime does), a spawned rank that ended at once
    # left its process to take another rank's task, with the first rank's variables,
    # counters and torch_xla's debug output (seen in 5 runs of 5 on 2 cores).
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, torch_xla\n"
        "\n"
        "def rank(index):\n"
        "    said = f\"rank {index} {os.getpid()} {os.environ['PJRT_LOCAL_PROCESS_RANK']}\\n\"\n"
        "    os.write(1, said.encode())  # one write: the two processes share the pipe\n"
        "\n"
        "if __name__ == '__main__':\n"
        "    torch_xla.launch(rank)\n"
    )
    command = [sys.executable, "-m", "tpunb.simulate", "--cores", "2"]
    result = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = sorted(line.split() for line in result.stdout.splitlines() if line.startswith("rank"))
    assert [(index, rank) for _, index, _, rank in ranks] == [("0", "0"), ("1", "1")]
    assert ranks[0][2] != ranks[1][2], result.stdout  # two processes
