"""What TPU programs and libraries written without tpunb see on simulated cores: a TPU,
their own metrics, torch_xla's debug output naming their own lines, their profiler traces
intact, and Accelerate's TPU branch (tests/third_party/, run as their authors would)."""

import os
import re
import subprocess
import sys

import pytest

THIRD_PARTY = os.path.join(os.path.dirname(__file__), "third_party")


def _simulated(script_and_args, cores=8, env=None, timeout=300):
    """``python -m tpunb.simulate --cores N ...``, the README's entry point for scripts."""
    result = subprocess.run(
        [sys.executable, "-m", "tpunb.simulate", "--cores", str(cores), *script_and_args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _script(name):
    return os.path.join(THIRD_PARTY, name)


def test_a_step_inside_a_profiler_trace_with_its_all_reduce_runs():
    # The simulation's cut before a collective once reset the IR scope of the user's
    # trace: "Expecting scope to be empty but it is train_step.1".
    result = _simulated([_script("profiled_step.py")], cores=2)
    assert "2 cores, 3 traced steps, same weights: True" in result.stdout


def test_a_rank_starts_on_a_tpu_with_no_transfer_or_fallback_counted():
    result = _simulated([_script("rank_start.py")], cores=2)
    # The ranks print at once: their lines may run into each other.
    lines = sorted(re.findall(r"rank \d+: .*?autocast \S+?bfloat16", result.stdout))
    assert lines == [
        f"rank {rank}: fallbacks [], transfers None, hardware TPU, device type TPU, "
        "autocast torch.bfloat16"
        for rank in range(2)
    ], result.stdout


def _analyses(stderr):
    """torch_xla's PT_XLA_DEBUG analyses: (cause, frames) for each."""
    found = []
    for block in re.split(r"(?:Compilation|Execution) Analysis: =+\n", stderr):
        cause = re.search(r"Analysis: (?:Compilation|Execution) Cause\n.*?Analysis:\s+(.*)", block)
        if cause is None:
            continue
        frames = re.findall(r"Analysis:\s+(\S+) \((.+):(\d+)\)", block)
        found.append((cause.group(1), frames))
    return found


def test_torch_xlas_debug_output_names_the_users_sync_and_line(tmp_path):
    script = _script("sync_debug.py")
    command = [script]
    # Written to a file, where torch_xla appends each analysis whole: on stderr the analyses
    # of two rank processes can interleave, and one seen run parsed 5 of them.
    debug = tmp_path / "debug.txt"
    _simulated(command, cores=2, env={"PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": str(debug)})
    output = debug.read_text()
    analyses = _analyses(output)
    kinds = re.findall(r"Analysis: (Compilation|Execution) Cause", output)
    # As on a v5e-8, only the host's first process (PJRT_LOCAL_PROCESS_RANK 0) prints: its 2
    # graphs (the first step's, then the others') compiled, its 3 steps executed.
    assert sorted(kinds) == ["Compilation"] * 2 + ["Execution"] * 3, output[-3000:]
    line = next(n for n, text in enumerate(open(script), 1) if "torch_xla.sync()  #" in text)
    for cause, frames in analyses:
        assert cause == "user torch_xla.sync"
        (sync, sync_file, _), (user, user_file, user_line) = frames[:2]
        assert (sync, os.path.basename(sync_file)) == ("sync", "torch_xla.py")
        assert (user, user_file, int(user_line)) == ("train", script, line)


def test_a_launch_leaves_torch_xlas_debug_output_to_the_user(tmp_path):
    # tpunb.launch records each step at its sync, on a TPU too: no frame of its own there.
    program = tmp_path / "program.py"
    program.write_text(
        "import torch, torch_xla, tpunb\n"
        "\n"
        "def train(rank):\n"
        "    weights = torch.ones(4, device=torch_xla.device())\n"
        "    for _ in range(2):\n"
        "        weights = weights * 0.5 + 1\n"
        "        torch_xla.sync()\n"
        "\n"
        "if __name__ == '__main__':\n"
        "    tpunb.simulate(cores=1)\n"
        "    tpunb.launch(train, live=False)\n"
    )
    result = subprocess.run(
        [sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PT_XLA_DEBUG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    users = [a for a in _analyses(result.stderr) if ("train", str(program), "7") in a[1]]
    assert len(users) >= 2, result.stderr[-3000:]
    for cause, frames in users:
        assert cause == "user torch_xla.sync"
        assert frames[1] == ("train", str(program), "7")


@pytest.mark.pair("kaggle", reason="Accelerate is preinstalled in Kaggle's TPU image")
@pytest.mark.parametrize("how", ["notebook_launcher", "accelerate launch --tpu"])
def test_accelerate_runs_its_tpu_branch(how):
    script = _script("accelerate_training.py")
    if how == "notebook_launcher":  # in a Kaggle notebook: its image sets KAGGLE_* variables
        result = _simulated([script], env={"KAGGLE_KERNEL_RUN_TYPE": "Interactive"})
        assert "Launching a training on TPU cores." in result.stdout
    else:
        launch = ["-m", "accelerate.commands.launch", "--tpu", "--main_training_function"]
        result = _simulated([*launch, "main", script])
    said = result.stdout
    assert said.count("DistributedType.XLA on 8 processes, same weights: True") == 1, said
    ranks = sorted(re.findall(r"process \d+, local \d+, main (?:True|False)", said))
    assert ranks == [f"process {r}, local {r}, main {r == 0}" for r in range(8)], said


@pytest.mark.pair(
    "kaggle", reason="the process layout as on Kaggle's v5e-8; the pairs' dynamo alike"
)
def test_collectives_compiled_with_fullgraph_give_every_call_its_result():
    # dynamo refused the simulation's collective ("Skip calling torch.compiler.disable()d
    # function"), and dist.all_reduce gave each rank its own value; on a v5e-8 process the
    # collective compiles into the graph.
    result = _simulated([_script("compiled_collectives.py")], cores=2)
    lines = sorted(re.findall(r"rank \d+: \d of 9 compiled results right", result.stdout))
    assert lines == [f"rank {rank}: 9 of 9 compiled results right" for rank in range(2)]


@pytest.mark.pair("colab", reason="torch_xla 2.9's dynamo tests, whose style the script follows")
def test_collectives_compiled_without_fullgraph_give_every_call_its_result():
    # Without fullgraph the backend partitions around the collectives: dist.all_gather_into_tensor
    # crashed ("Failed to get computation by hash"), a compiled broadcast returned its first
    # call's result at every call, and dynamic=True was refused. A broadcast and the work after
    # it run as one graph, as on a TPU (torch_xla's test_traceable_collectives.py counts it);
    script = _script("compiled_without_fullgraph.py")
    result = _simulated([script], cores=2)
    # The ranks' prints may interleave: each is matched whole, wherever it is.
    said = r"rank \d+: \d+ of 24 right, \d of 6 broadcasts one graph, counted (?:True|False)"
    lines = sorted(re.findall(said, result.stdout))
    assert lines == [
        f"rank {rank}: 24 of 24 right, 6 of 6 broadcasts one graph, counted True"
        for rank in range(2)
    ], result.stdout[-3000:]


@pytest.mark.pair("colab", reason="the pairs' torch.distributed alike: checked once")
def test_torch_distributed_counts_its_collectives_and_ddp_bucket_views():
    # The simulation computes collectives on the host, where torch_xla's C++ counters were
    # not counted; it counts them as torch_xla would. DDP's bucket views train as on the
    # CPU: the host all-reduce writes the bucket through copy_, which its views see (on a
    # TPU XLA's in-place all-reduce sets the bucket beneath functionalization;
    # docs/simulation.md).
    script = _script("distributed_counters_and_ddp.py")
    result = _simulated([script], cores=2)
    said = r"rank (\d+): counters (True|False), bucket views train as the CPU (True|False)"
    ranks = sorted(re.findall(said, result.stdout))  # the ranks' prints may interleave
    assert ranks == [("0", "True", "True"), ("1", "True", "True")], result.stdout[-3000:]


def test_an_eager_collective_runs_as_one_eager_computation_as_on_a_tpu():
    result = _simulated([_script("eager_collective.py")], cores=2)
    # The processes print to one pipe: a line may land inside another's.
    said = sorted(
        re.findall(r"rank \d: TPU, eager executions \d+, lazy \d+, sums \d+ \d+", result.stdout)
    )
    # 0 + 1 = 1, in place in both tensors, one eager execution and no lazy one.
    expected = "TPU, eager executions 1, lazy 0, sums 1 1"
    assert said == [f"rank {rank}: {expected}" for rank in range(2)], result.stdout


RANDOM_STEPS = """\
import torch, torch_xla, torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

def steps(device, all_reduce):  # what 3 steps drew, and the MarkSteps they counted
    xm.set_rng_state(0)
    weights, drawn, marks = torch.ones(4, device=device), [], met.counter_value("MarkStep")
    for _ in range(3):
        before = torch.rand(4, device=device)
        weights = weights * 0.5
        if all_reduce:
            weights = xm.all_reduce(xm.REDUCE_SUM, weights)
        after = torch.rand(4, device=device)
        torch_xla.sync()
        drawn.append(round(float((before + after).sum()), 5))
    return drawn, met.counter_value("MarkStep") - (marks or 0)

def train(index):
    device = torch_xla.device()
    with_it, without = steps(device, True), steps(device, False)
    print(f"rank {index}: MarkSteps {with_it[1]} and {without[1]}, "
          f"the same draws {with_it[0] == without[0]}", flush=True)

if __name__ == '__main__':
    torch_xla.launch(train)
"""


@pytest.mark.pair("colab", reason="the simulation's collectives alike on both pairs: checked once")
def test_a_collective_inside_a_step_neither_ends_the_step_nor_moves_the_random_seed(tmp_path):
    # On a TPU the collective is in the step's graph: a step counts one MarkStep and draws
    # the same random numbers with or without it. A simulated core runs the step's work
    # before the collective (on the host) without marking a step: the same holds.
    program = tmp_path / "program.py"
    program.write_text(RANDOM_STEPS)
    result = _simulated([str(program)], cores=2)
    lines = sorted(re.findall(r"rank \d: MarkSteps .*", result.stdout))
    assert lines == [f"rank {rank}: MarkSteps 3 and 3, the same draws True" for rank in range(2)], (
        result.stdout
    )
