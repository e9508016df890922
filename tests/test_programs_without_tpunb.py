"""TPU programs written for torch_xla only, run unchanged on simulated cores: a script
through ``python -m tpunb.simulate`` (spawn start method), a plain ``xmp.spawn`` after
``tpunb.simulate()``, and a Kaggle notebook through ``pytest --tpunb-simulate``."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import launch_leftovers, run_python

THIRD_PARTY = os.path.join(os.path.dirname(__file__), "third_party")


def _run(args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


@pytest.mark.pair("colab", reason="spawn alike on both pairs; a failing spawned rank on Kaggle's")
def test_a_script_runs_unchanged_with_the_spawn_start_method():
    script = os.path.join(THIRD_PARTY, "train_script.py")
    # 4 cores: each spawned rank is a new interpreter importing torch_xla (CI time).
    result = _run(["-m", "tpunb.simulate", "--cores", "4", script, "--lr", "0.05"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 4, same weights on every core: True" in result.stdout
    # Without the simulation the same script runs on one CPU device.
    result = _run([script, "--lr", "0.05"])
    assert "world size 1" in result.stdout, result.stderr[-3000:]


@pytest.mark.pair("kaggle", reason="spawn alike on both pairs; a script spawned whole on Colab's")
def test_a_spawned_rank_that_fails_stops_the_script_at_once_with_its_error():
    script = os.path.join(THIRD_PARTY, "failing_script.py")
    before = {p.pid for p in launch_leftovers()}
    # The other ranks wait in the all-reduce: they stop with rank 3's end (a TPU would wait
    # forever, past _run's time-out; XLA's own rendezvous would abort them with its own error).
    result = _run(["-m", "tpunb.simulate", "--cores", "4", script])
    assert result.returncode == 1
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line == "ValueError: rank 3 found no data", result.stderr[-3000:]
    assert {p.pid for p in launch_leftovers()} == before


@pytest.mark.pair("colab", reason="torchrun's processes start alike on both pairs")
def test_a_script_torchrun_starts_runs_unchanged_a_process_a_core():
    script = os.path.join(THIRD_PARTY, "torchrun_script.py")
    before = set(os.listdir("/dev/shm"))
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = _run([*torchrun, "-m", "tpunb.simulate", "--cores", "2", script])
    assert result.returncode == 0, result.stderr[-3000:]
    # The two processes print to one pipe: a line may land inside the other's.
    lines = sorted(re.findall(r"rank \d of \d on xla:\d: sum \d+", result.stdout))
    assert lines == ["rank 0 of 2 on xla:0: sum 3", "rank 1 of 2 on xla:0: sum 3"]
    # Local rank 0 closed the meeting once both had ended: nothing left in shared memory.
    assert not {name for name in set(os.listdir("/dev/shm")) - before if "tpunb" in name}
    # Started for another count of cores, a rank says so before anything runs.
    result = _run([*torchrun, "-m", "tpunb.simulate", "--cores", "8", script])
    assert "torchrun started 2 processes on this host (2 in all) for 8 simulated" in result.stderr
    # Ranks that take different paths wait, as on a TPU, until the simulation's judge of
    # their calls names them, with their lines (no launch is there to).
    result = _run([*torchrun, "-m", "tpunb.simulate", "--cores", "2", script, "--diverge"])
    assert result.returncode == 1
    assert "at their collective call number 2 they made different calls" in result.stderr
    assert "rank 1: made none: returned after 1 collective call" in result.stderr
    assert "Their paths parted earlier, at call number 1" in result.stderr
    assert "torchrun_script.py, line 18 (through torch_xla's allreduce)" in result.stderr


def test_the_command_line_says_what_is_wrong_before_running_anything(tmp_path):
    result = _run(["-m", "tpunb.simulate", str(tmp_path / "missing.py")])
    assert result.returncode == 2 and "no such script" in result.stderr
    result = _run(["-m", "tpunb.simulate", "--cores", "0", str(tmp_path / "missing.py")])
    assert result.returncode != 0


def test_importing_the_command_line_module_keeps_tpunb_simulate_a_function():
    result = run_python(
        """
        import tpunb.simulate
        import tpunb
        print(callable(tpunb.simulate), tpunb.simulate.__doc__.split(":")[0])
        """
    )
    assert result.stdout.startswith("True"), result.stderr


def test_a_plain_xmp_spawn_after_simulate_works_and_a_failing_rank_stops_it():
    result = run_python(
        """
        import time
        import tpunb
        tpunb.simulate(cores=8)
        import torch, torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_multiprocessing as xmp

        def step(index, fail):
            device = torch_xla.device()
            total = xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=device))
            if fail and index == 5:
                raise KeyError("rank 5")
            xm.all_reduce(xm.REDUCE_SUM, total)  # the others wait here for rank 5
            torch_xla.sync()

        xmp.spawn(step, args=(False,), start_method="fork")
        print("no failure: returned")
        try:
            xmp.spawn(step, args=(True,), start_method="fork")
        except KeyError as error:
            print("raised", repr(error))
        """
    )
    assert result.stdout.splitlines()[-2:] == [
        "no failure: returned",
        "raised KeyError('rank 5')",
    ], result.stderr[-3000:]


def _pytest(args, cwd):
    return _run(["-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd)


@pytest.mark.pair("kaggle", reason="a Kaggle notebook, on Kaggle's torch_xla")
def test_a_kaggle_notebook_runs_unchanged_in_ci_through_the_pytest_option(tmp_path):
    # A user's repository: their notebook, no pytest configuration of tpunb's.
    shutil.copy(os.path.join(THIRD_PARTY, "kaggle_ddp.ipynb"), tmp_path)
    result = _pytest(["--nbval-lax", "--tpunb-simulate=8", "kaggle_ddp.ipynb"], tmp_path)
    assert result.returncode == 0 and "4 passed" in result.stdout, result.stdout[-3000:]
    # torch_xla's DDP recipe, done right: the report finds nothing.
    assert "tpunb's report (1 launch watched): nothing found that a TPU" in result.stdout
    # Without the option there is no TPU here, nor the variables Kaggle's image presets.
    result = _pytest(["--nbval-lax", "kaggle_ddp.ipynb"], tmp_path)
    assert result.returncode == 1 and "KeyError" in result.stdout


def test_plain_tests_of_tpu_code_run_on_the_simulated_cores(tmp_path):
    (tmp_path / "test_tpu_code.py").write_text(
        "import torch_xla.distributed.xla_multiprocessing as xmp\n"
        "import torch_xla.runtime as xr\n\n\n"
        "def _world(index):\n"
        "    assert xr.world_size() == 8\n\n\n"
        "def test_every_core():\n"
        "    xmp.spawn(_world, start_method='fork')\n\n\n"
        "def _read_whole(index):\n"
        "    import torch\n"
        "    from torch.utils.data import DataLoader\n\n"
        "    for batch in DataLoader(torch.arange(32.0), batch_size=4):\n"
        "        pass\n\n\n"
        "def test_every_core_reads_the_data():\n"
        "    xmp.spawn(_read_whole, start_method='fork')\n"
    )
    result = _pytest(["--tpunb-simulate=8", "test_tpu_code.py"], tmp_path)
    assert result.returncode == 0 and "2 passed" in result.stdout, result.stdout[-3000:]
    # The session ends with the report: the second test's loader, read whole by every core.
    report = result.stdout[result.stdout.index("tpunb's report") :].splitlines()
    assert report[0] == "tpunb's report (2 launches watched): what a TPU would meet, and the fix"
    tests = tmp_path / "test_tpu_code.py"
    assert report[1].startswith(
        f"  1. xmp.spawn at {tests}, line 22: the DataLoader built at {tests}, line 17 gave "
        "every one of the 8 cores the same batches (its sampler: SequentialSampler)"
    ), report
    assert len(report) == 2 or not report[2].startswith("  2."), report
    result = _pytest(["--tpunb-simulate=0", "test_tpu_code.py"], tmp_path)
    assert result.returncode == 4 and "--tpunb-simulate=0" in result.stderr, result.stderr


# On Colab's pair: torch_xla 2.9 lowers dist.send and dist.recv to a collective_permute of
# one pair; 2.8's raise NotImplementedError (make_send_channel_id), on a TPU too.
@pytest.mark.pair("colab", reason="torch.distributed's send and recv are torch_xla 2.9's")
def test_send_and_recv_through_torch_distributed_pair_the_ranks_they_name():
    script = os.path.join(THIRD_PARTY, "point_to_point.py")
    command = ["-m", "tpunb.simulate", "--cores", "4", script]
    result = _run(command)
    assert result.returncode == 0, result.stderr[-3000:]
    said = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert said == [f"rank {rank}: pipeline right, ring right" for rank in range(4)]
    # A real divergence is still named: rank 1 receives a shape rank 0 did not send.
    result = _run([*command, "--mismatch"])
    assert result.returncode == 1
    assert "Ranks 0 and 1 cannot pair up: rank 0 sent collective_permute(float32[2, 4]" in (
        result.stderr
    ), result.stderr[-3000:]


@pytest.mark.pair("kaggle", reason="a Kaggle notebook, on Kaggle's torch_xla")
def test_a_notebook_saved_with_outputs_but_no_execution_counts_runs(tmp_path):
    # As some notebook services export them, and as a cell run alone leaves it: outputs,
    # no execution count. nbval refuses such cells ("Unrun reference cell has outputs"),
    # though under --nbval-lax it would not compare their outputs.
    notebook = json.loads(open(os.path.join(THIRD_PARTY, "kaggle_ddp.ipynb")).read())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for cell in code:
        if "NBVAL_CHECK_OUTPUT" not in "".join(cell["source"]):
            cell["execution_count"] = None
            cell["outputs"] = cell["outputs"] or [
                {"output_type": "stream", "name": "stdout", "text": ["saved on a TPU\n"]}
            ]
            for output in cell["outputs"]:
                output.pop("execution_count", None)
    (tmp_path / "exported.ipynb").write_text(json.dumps(notebook))
    result = _pytest(["--nbval-lax", "--tpunb-simulate=8", "exported.ipynb"], tmp_path)
    assert result.returncode == 0 and "4 passed" in result.stdout, result.stdout[-3000:]
    assert "tpunb: 3 cell(s) saved with outputs but no execution count ran" in result.stdout
    # A cell whose outputs nbval compares (NBVAL_CHECK_OUTPUT) keeps nbval's error.
    code[-1]["execution_count"] = None
    (tmp_path / "exported.ipynb").write_text(json.dumps(notebook))
    result = _pytest(["--nbval-lax", "--tpunb-simulate=8", "exported.ipynb"], tmp_path)
    assert result.returncode == 1 and "Unrun reference cell has outputs" in result.stdout


@pytest.mark.pair("colab", reason="nbval and the plugin alike on both pairs: checked once")
def test_a_cell_that_fails_under_nbval_shows_what_it_printed(tmp_path):
    # nbval names a stream the saved cell lacks, not its text: the plugin adds the text.
    cell = {
        "cell_type": "code",
        "id": "aside",
        "execution_count": 1,
        "metadata": {},
        "outputs": [{"output_type": "stream", "name": "stdout", "text": ["saved\n"]}],
        "source": ["import sys\n", "print('saved')\n", "print('said aside', file=sys.stderr)"],
    }
    notebook = {"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "aside.ipynb").write_text(json.dumps(notebook))
    result = _pytest(["--nbval", "aside.ipynb"], tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "Unexpected output fields from running code: {'stderr'}" in result.stdout
    section = result.stdout[result.stdout.index("the cell's stderr") :].splitlines()
    assert section[1] == "said aside", result.stdout[-3000:]
