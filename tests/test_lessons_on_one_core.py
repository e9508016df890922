"""Every lesson on one core, as on Colab's TPU (a v5e-1 or a v6e-1): it runs, and where its
point needs several cores it says so and how to see them. (On 8 simulated cores the
lessons run under nbval with their committed outputs.)"""

import concurrent.futures
import shutil

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

# What each lesson says on one core, beside running without an error.
SAYS_ON_ONE_CORE = {
    "00_quickstart.ipynb": ["ranks that returned a result: 1", "weights identical to core 0: True"],
    "01_core_count.ipynb": [
        "rank 0: world_size 1, global ordinal 0",
        "tpunb.launch: The XLA",
        "in the notebook's own process, compiling 2 graphs",
    ],
    "02_sampler.ipynb": ["With 1 core there is nothing to split", "seen by every core: 1792"],
    "03_batch_size.ipynb": ["With 1 core the global batch is the per-core batch"],
    "04_tensor_evaluation.ipynb": ["cores: 1", "loss.item()                graphs run a step: 2"],
    "05_shapes.ipynb": ["cores: 1", "bucketed:  4 batch shapes"],
    "06_resources.ipynb": ["cores: 1", "killed by SIGKILL", "the trace holds the steps: True"],
    "07_lightning.ipynb": ["OneCoreXLAStrategy, cores: 1", "distinct samples: 1408 of 1437"],
    "08_hangs.ipynb": [
        "With 1 core there is no other core to wait for",
        "finished: with one core there is no other core to wait for",
        "finished: 1797 samples on the one core",
    ],
    "09_whole_job.ipynb": [
        "python -m tpunb.simulate --cores 1 train.py",
        "1 cores; global batch 16 x 1 cores x 2 micro-batches = 32",
        "epoch 3: train loss",
        "on 360 samples",
        "resumed after epoch 2",
    ],
}
LESSONS = sorted(SAYS_ON_ONE_CORE)


def _run_on_one_core(folder, lesson):
    """Runs a copy of the lesson on one core, in a folder of its own, and returns everything
    it printed."""
    folder = folder / lesson.removesuffix(".ipynb")
    folder.mkdir()
    path = folder / lesson
    shutil.copy(ROOT / "notebooks" / lesson, path)
    notebook = nbformat.read(path, as_version=4)
    # One core before the lesson's own first cell, as the TPU of Colab's runtime gives.
    notebook.cells.insert(0, nbformat.v4.new_code_cell("import tpunb\ntpunb.simulate(cores=1)"))
    where = {"metadata": {"path": str(folder)}}
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources=where).execute()
    return "\n".join(
        "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


@pytest.fixture(scope="module")
def printed_on_one_core(tmp_path_factory):
    """Every lesson run on one core, two kernels at a time: a kernel spends most of a
    one-core lesson importing torch_xla and tracing in one Python thread, so two side by
    side take little longer than one. A lesson that fails raises in its own test."""
    folder = tmp_path_factory.mktemp("one_core")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as kernels:
        runs = {lesson: kernels.submit(_run_on_one_core, folder, lesson) for lesson in LESSONS}
    return runs


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_lesson_runs_on_one_core_and_says_what_it_shows_there(lesson, printed_on_one_core):
    printed = printed_on_one_core[lesson].result()
    for expected in SAYS_ON_ONE_CORE[lesson]:
        assert expected in printed, f"{lesson} on one core: {expected!r} not in its outputs"
