"""``python -m tpunb.simulate notebook.ipynb``: a TPU notebook, unchanged, run cell by cell
in a Jupyter kernel on simulated cores, a line a cell; installs fail at once offline, and
the exit status says whether every cell ran."""

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
    assert [tuple(line.split()[2:4]) for line in progress] == [(str(n), "ok") for n in range(1, 5)]
    # Each line shows the notebook's own cell: its first line.
    assert "%pip install --quiet" in progress[0] and "import torch_xla" in progress[3]
    # The install of a missing package failed at once, said so, and the run went on.
    assert "pip cannot reach the network here" in result.stdout
    assert "the requirement a-package-that-is-not-installed-here" in result.stdout
    assert "\x1b[" not in result.stdout  # no terminal colours
    assert lines[-1].startswith("every cell ran")
    # Each of the 4 ranks ran in the notebook's folder and saw 4 cores.
    assert sorted(os.listdir(tmp_path)) == ["kaggle.ipynb"] + [f"rank{r}.txt" for r in range(4)]
    assert {(tmp_path / f"rank{r}.txt").read_text() for r in range(4)} == {"4"}


def test_a_cell_that_raises_stops_the_run_and_the_exit_status_says_so(tmp_path):
    cells = ["x = 1", 'raise ValueError("a bad path")', "print('never')"]
    result = _check(_notebook(tmp_path, cells), cores=2)
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    assert "ValueError: a bad path" in result.stdout
    assert "stopped at cell 2: the cells after it did not run" in result.stdout
    assert "never" not in result.stdout
