import concurrent.futures
import importlib.metadata
import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import psutil
import pytest

import tpunb

# TPU programs written without tpunb: test_programs_without_tpunb.py runs them as their
# authors would, not as part of this collection.
collect_ignore = ["third_party"]

ROOT = pathlib.Path(__file__).parent.parent

# Which run of the lessons each platform pair makes, so that each lesson runs once a pair:
# on Kaggle's pair (torch_xla 2.8) on 8 simulated cores under nbval, against their committed
# outputs, as on Kaggle's v5e-8; on Colab's pair (torch_xla 2.9) on one core, as on Colab's
# v5e-1 or v6e-1 (test_lessons_on_one_core.py). With another torch_xla, both run. (The hook
# sees the notebooks' items too: it runs for the whole collection.)
_EIGHT_CORES = "2.8"  # Kaggle's pair: its TPU has 8 cores
_ONE_CORE = "2.9"  # Colab's pair: its TPU has one


def _pair():
    try:
        return ".".join(importlib.metadata.version("torch_xla").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_collection_modifyitems(config, items):
    pair = _pair()
    for item in items:
        lesson_on_8 = item.path.suffix == ".ipynb" and item.path.parent.name == "notebooks"
        lesson_on_1 = item.path.name == "test_lessons_on_one_core.py"
        if lesson_on_8 and pair == _ONE_CORE:
            item.add_marker(
                pytest.mark.skip(
                    reason="Colab's pair (torch_xla 2.9, one TPU core) runs each lesson on one "
                    "core; Kaggle's pair (2.8) runs them on 8 under nbval"
                )
            )
        elif lesson_on_1 and pair == _EIGHT_CORES:
            item.add_marker(
                pytest.mark.skip(
                    reason="Kaggle's pair (torch_xla 2.8, 8 TPU cores) runs the lessons on 8 "
                    "cores under nbval; Colab's pair (2.9) runs each on one core"
                )
            )


@pytest.fixture(autouse=True)
def restore_environment():
    """Every test leaves os.environ as it found it (simulate() sets variables)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def cores8():
    """8 TPU cores simulated on the CPU with the real torch_xla, in the layout that
    follows the machine (one process of threads on fewer than 8 CPUs)."""
    tpunb.simulate(cores=8)
    return 8


@pytest.fixture
def cores8_processes():
    """8 TPU cores simulated in 8 processes, as a TPU v5e-8 runs them."""
    tpunb.simulate(cores=8, layout="processes")
    return 8


@pytest.fixture
def cores8_threads():
    """8 TPU cores simulated as threads of one process, for what only that layout has."""
    tpunb.simulate(cores=8, layout="threads")
    return 8


@pytest.fixture(params=["processes", "threads"])
def cores8_each_layout(request):
    """8 simulated TPU cores in each layout: a process a core, and one process of threads."""
    tpunb.simulate(cores=8, layout=request.param)
    return request.param


def launch_leftovers():
    """This process's descendants, less torch's own compile-worker pool (which importing
    torch_xla 2.8 starts in the notebook's process, and which lives as long as it does)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if not any("_inductor/compile_worker" in part for part in p.cmdline())
    ]


@pytest.fixture
def no_children_left():
    """Fails the test if a launch left any process behind."""
    yield
    leftover = launch_leftovers()
    assert leftover == [], f"processes left behind: {leftover}"


def run_python(code, timeout=120):
    """Runs ``code`` in a fresh Python process (for what would poison this one)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_forked_process(fn, *args):
    """``fn(*args)`` in a forked child. A backward pass in this process would start
    PyTorch's autograd engine here and break XLA backward in every later launch
    (https://github.com/pytorch/xla/issues/4174), so CPU references run there."""
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pickle.loads(pool.submit(_pickled_call, fn, *args).result())


def _pickled_call(fn, *args):
    return pickle.dumps(fn(*args))
