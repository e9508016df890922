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

# torch's inductor starts a pool of compile workers as it is imported
# (AsyncCompile.warm_pool in torch/_inductor/async_compile.py, where triton is installed),
# and torch_xla's dynamo bridge imports it: in every process that imports torch_xla, the
# scripts' spawned rank processes and the lessons' kernels among them, that is about 4 s of
# CPU, and 4 s more at exit, on this 2-CPU machine. torch_xla's openxla backend never uses
# the pool. Off for the test session and every process and kernel it starts.
os.environ.setdefault("TORCH_WARM_POOL", "0")

# TPU programs written without tpunb: test_programs_without_tpunb.py runs them as their
# authors would, not as part of this collection.
collect_ignore = ["third_party"]

ROOT = pathlib.Path(__file__).parent.parent

# What each platform pair runs, so that CI runs nothing twice that the pairs would run alike:
# the lessons on Kaggle's pair (torch_xla 2.8) on 8 simulated cores under nbval, against
# their committed outputs, as on Kaggle's v5e-8; on Colab's pair (torch_xla 2.9) each on one
# core, as on Colab's v5e-1 or v6e-1 (test_lessons_on_one_core.py); a test marked
# ``@pytest.mark.pair("colab")`` or ``("kaggle")`` on that pair only. With another
# torch_xla, everything runs.
# (The hook sees the notebooks' items too: it runs for the whole collection.)
_PAIRS = {"2.9": "colab", "2.8": "kaggle"}


def _pair():
    try:
        version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return None
    return _PAIRS.get(".".join(version.split(".")[:2]))


def pytest_collection_modifyitems(config, items):
    pair = _pair()
    if pair is None:
        return
    for item in items:
        if item.path.suffix == ".ipynb" and item.path.parent.name == "notebooks":
            only = "kaggle"
            why = "the lessons run on 8 cores under nbval on Kaggle's pair, on one core here"
        elif item.path.name == "test_lessons_on_one_core.py":
            only = "colab"
            why = "the lessons run on one core on Colab's pair, on 8 under nbval here"
        else:
            marker = item.get_closest_marker("pair")
            if marker is None:
                continue
            only, why = marker.args[0], marker.kwargs.get("reason", "")
        if only != pair:
            item.add_marker(pytest.mark.skip(reason=f"on {only.capitalize()}'s pair only: {why}"))


@pytest.fixture(autouse=True)
def restore_environment():
    """Every test leaves os.environ as it found it (simulate() sets variables)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def cores8():
    """8 TPU cores simulated on the CPU with the real torch_xla: a process a core, as on a
    TPU v5e-8."""
    tpunb.simulate(cores=8)
    return 8


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
    # One thread: this test process may have run torch's OpenMP threads (a comparison of
    # large tensors), and a forked child hangs in its first parallel region with more
    # (https://github.com/pytorch/pytorch/issues/17199).
    import torch

    torch.set_num_threads(1)
    return pickle.dumps(fn(*args))
