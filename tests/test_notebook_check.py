"""``python -m tpunb.simulate notebook.ipynb``: a TPU notebook, unchanged, run cell by cell
in a Jupyter kernel on simulated cores, a line a cell; installs fail at once offline; the
run ends with tpunb's report of what a TPU would meet, each finding at its cell and line,
and the exit status says whether every cell ran and whether the report found anything."""

import os
import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

POP_PRESETS = """\
import os
for name in ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID"):
    os.environ.pop(name, None)
"""
SPAWN = """\
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr


def world(index):
    open(f"rank{xr.global_ordinal()}.txt", "w").write(str(xr.world_size()))


xmp.spawn(world, start_method="fork")
"""
KAGGLE_STYLE = [
    '%pip install --quiet "tpunb @ git+https://github.com/tpunb/tpunb@v0.2.0"',
    "%pip install --quiet a-package-that-is-not-installed-here",
    POP_PRESETS,
    SPAWN,
]


def _notebook(folder, cells):
    path = folder / "kaggle.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell(source) for source in cells]), path)
    return path


def _check(path, cores=4):
    return subprocess.run(
        [sys.executable, "-m", "tpunb.simulate", "--cores", str(cores), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=path.parent,
    )


def test_a_notebook_runs_cell_by_cell_on_simulated_cores(tmp_path):
    result = _check(_notebook(tmp_path, KAGGLE_STYLE))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "kaggle.ipynb: 4 code cells on 4 simulated cores"
    progress = [line for line in lines[1:] if line.startswith("[")]
    outcomes = [tuple(line.split()[1:3]) for line in progress]
    assert outcomes == [(f"In[{n}]", "ok") for n in range(1, 5)]
    # Each line shows the notebook's own cell: its first line.
    assert "%pip install --quiet" in progress[0] and "import torch_xla" in progress[3]
    # The install of a missing package failed at once, said so, and the run went on.
    assert "pip cannot reach the network here" in result.stdout
    assert "the requirement a-package-that-is-not-installed-here" in result.stdout
    assert "\x1b[" not in result.stdout  # no terminal colours
    assert "without encryption" not in result.stderr  # the kernel's sockets are local files
    assert "Parent appears to have exited" not in result.stderr  # the kernel was shut down
    assert lines[-2].startswith("every cell ran")
    assert lines[-1] == "tpunb's report (1 launch watched): nothing found that a TPU would meet."
    # Each of the 4 ranks ran in the notebook's folder and saw 4 cores.
    assert sorted(os.listdir(tmp_path)) == ["kaggle.ipynb"] + [f"rank{r}.txt" for r in range(4)]
    assert {(tmp_path / f"rank{r}.txt").read_text() for r in range(4)} == {"4"}


def test_a_cell_that_raises_stops_the_run_and_the_exit_status_says_so(tmp_path):
    cells = ["x = 1", 'raise ValueError("a bad path")', "print('never')"]
    result = _check(_notebook(tmp_path, cells), cores=2)
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    assert "ValueError: a bad path" in result.stdout
    assert "stopped at In[2]: the cells after it did not run" in result.stdout
    assert "never" not in result.stdout


# A notebook written for torch_xla alone, with every pitfall the report names.
SETUP = """\
import os
for name in ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID"):
    os.environ.pop(name, None)
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch_xla.distributed.parallel_loader import MpDeviceLoader

data = TensorDataset(torch.randn(70, 4), torch.randn(70, 1))
"""
TRAIN_WITH_PITFALLS = """\
def train(index):
    loader = DataLoader(data, batch_size=8, shuffle=True)
    device = torch_xla.device()
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in MpDeviceLoader(loader, device):
            loss = ((model(x) - y) ** 2).mean() + model(x)[y > 0].sum() * 0
            optimizer.zero_grad()
            loss.backward()
            xm.optimizer_step(optimizer)
            if loss.item() > 1e6:
                break


xmp.spawn(train, start_method="fork")
"""
TRAIN_FIXED = """\
def train(index):
    sampler = DistributedSampler(data, num_replicas=xr.world_size(), rank=xr.global_ordinal())
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
    device = torch_xla.device()
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in MpDeviceLoader(loader, device):
            loss = ((model(x) - y) ** 2).mean() + (model(x) * (y > 0)).sum() * 0
            optimizer.zero_grad()
            loss.backward()
            xm.optimizer_step(optimizer)
    return loss.item()


xmp.spawn(train, start_method="fork")
"""
COLLECTIVE = """\
def {name}(index):
    if {condition}:
        xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=torch_xla.device()))
    else:
        xm.all_gather(torch.ones(2, device=torch_xla.device()))
    torch_xla.sync()


{launch}
"""
DIVERGING = COLLECTIVE.format(
    name="uneven",
    condition="xr.global_ordinal() == 0",
    launch='try:\n    xmp.spawn(uneven, start_method="fork")\nexcept Exception as error:\n'
    "    print(type(error).__name__)",
)
EVEN = COLLECTIVE.format(
    name="even", condition="True", launch='xmp.spawn(even, start_method="fork")'
)
DEVICE_BEFORE_SPAWN = """\
print(torch.ones(2, device=torch_xla.device()))
xmp.spawn(train, start_method="fork")
"""


def _report(stdout):
    """The report's findings, a string each (a finding's continuation lines joined)."""
    lines = stdout[stdout.index("tpunb's report") :].splitlines()
    findings = []
    for line in lines[1:]:
        if line[:5].strip().rstrip(".").isdigit():
            findings.append(line.split(". ", 1)[1])
        elif findings:
            findings[-1] += "\n" + line.strip()
    return lines[0], findings


def test_each_pitfall_is_named_at_its_cell_and_line_with_its_fix(tmp_path):
    cells = [SETUP, TRAIN_WITH_PITFALLS, DIVERGING, DEVICE_BEFORE_SPAWN]
    result = _check(_notebook(tmp_path, cells))
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]  # the last cell raised
    heading, findings = _report(result.stdout)
    assert heading.startswith("tpunb's report (3 launches watched): what a TPU would meet")
    spawn = "xmp.spawn at cell In[2], line 16: "
    assert all(finding.startswith("xmp.spawn at cell In[") for finding in findings), findings

    def found(start, *words):
        return [f for f in findings if f.startswith(start) and all(w in f for w in words)]

    # A read that cut a step, at its own line (after xm.optimizer_step, whose all-reduce a
    # TPU runs inside the step's graph); the boolean mask's CPU fallback.
    assert found(spawn, ".item() at cell In[2], line 12 read a value the step had not computed")
    assert found(spawn, "ran aten::nonzero on the CPU", "Multiply by the mask")
    # Recompilations after the warm-up: the short last batch of each epoch.
    assert found(spawn, "compiled", "the short last batch of an epoch", "drop_last=True")
    # The loader every core read whole, where it was built.
    assert found(
        spawn,
        "the DataLoader built at cell In[2], line 2 gave every one of the 4 cores the same "
        "batches (its sampler: RandomSampler)",
        "sampler=DistributedSampler(",
    )
    # Ranks that diverged, each path at its line.
    assert found(
        "xmp.spawn at cell In[3], line 10: The ranks took different paths",
        "rank 0: all_reduce('sum', float32[2]) at cell In[3], line 3",
        "ranks 1-3: all_gather(float32[2]) at cell In[3], line 5",
    )
    # The runtime started before the spawn.
    assert found(
        "xmp.spawn at cell In[4], line 2: the XLA runtime was already started",
        "Move everything that touches the device into the function xmp.spawn runs",
    )
    assert len(findings) == 7, findings  # and the mask's changed graph, nothing else


def test_the_same_notebook_with_its_pitfalls_fixed_gets_an_empty_report(tmp_path):
    result = _check(_notebook(tmp_path, [SETUP, TRAIN_FIXED, EVEN]))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == (
        "tpunb's report (2 launches watched): nothing found that a TPU would meet."
    )


def _script(folder, train):
    """The notebook's cells as a script; (its path, the lines of its spawn and its read)."""
    text = SETUP + train.replace("xmp.spawn(", 'if __name__ == "__main__":\n    xmp.spawn(')
    path = folder / "train.py"
    path.write_text(text)
    lines = text.splitlines()
    spawn = next(n for n, line in enumerate(lines, 1) if "xmp.spawn(" in line)
    read = next((n for n, line in enumerate(lines, 1) if ".item() > " in line), None)
    return path, spawn, read


def test_a_script_gets_the_same_report_and_exit_status(tmp_path):
    script, spawn, read = _script(tmp_path, TRAIN_WITH_PITFALLS)
    result = _check(script)
    assert result.returncode == 4, result.stdout + result.stderr[-3000:]  # it ran; found some
    heading, findings = _report(result.stdout)
    assert heading.startswith("tpunb's report (1 launch watched)")
    where = f"xmp.spawn at {script}, line {spawn}: "
    assert any(
        f.startswith(where) and f".item() at {script}, line {read} read a value" in f
        for f in findings
    ), findings
    script, _, _ = _script(tmp_path, TRAIN_FIXED)
    result = _check(script)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "nothing found that a TPU would meet" in result.stdout
