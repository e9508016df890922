"""Where this Python runs (Colab, Kaggle, Binder, Jupyter, IPython or a script) and
whether its XLA runtime started, read from ``sys.modules`` and environment variables
without importing anything."""

import contextlib
import os
import sys

# Kaggle's TPU image presets these; torch_xla only `setdefault`s them, so the preset
# single-process values win and a multi-process spawn fails ("Expected 4 worker
# addresses, got 1"). https://github.com/Lightning-AI/pytorch-lightning/issues/19313,
# https://github.com/pytorch/xla/issues/8215
SPAWN_BREAKING_VARIABLES = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


def name():
    """``"colab"``, ``"kaggle"``, ``"binder"``, ``"jupyter"``, ``"ipython"`` or ``"script"``."""
    if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    if "BINDER_LAUNCH_HOST" in os.environ or "BINDER_REPO_URL" in os.environ:
        return "binder"
    if in_kernel():
        return "jupyter"
    if "IPython" in sys.modules:
        return "ipython"
    return "script"


def in_kernel():
    """True inside a Jupyter kernel (Jupyter, Colab, Kaggle and Binder notebooks)."""
    # A process can import ipykernel without being a kernel (nbval does): ask the running
    # IPython shell, if IPython is already imported, whether it serves a kernel.
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def draws_widgets():
    """True in a kernel whose front end most likely draws ipywidgets as they change: Colab,
    an interactive Kaggle session, a kernel started by a Jupyter server (JupyterLab,
    Notebook, Binder: it sets JPY_SESSION_NAME) or by VS Code. False where notebooks run
    headless (nbval, nbclient, papermill, Kaggle's "Save & Run All")."""
    if not in_kernel():
        return False
    where = name()
    if where == "colab":
        return True
    if where == "kaggle":
        return os.environ.get("KAGGLE_KERNEL_RUN_TYPE") == "Interactive"
    return "JPY_SESSION_NAME" in os.environ or "VSCODE_PID" in os.environ


def runtime_started():
    """True when the XLA runtime runs in this process (it cannot without torch_xla
    imported, so torch_xla is never imported to find out)."""
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and torch_xla._XLAC._xla_runtime_is_initialized()


def spawn_breaking_variables():
    """The preset variables (name -> value) that would break a multi-process spawn."""
    return {k: os.environ[k] for k in SPAWN_BREAKING_VARIABLES if k in os.environ}


@contextlib.contextmanager
def spawn_variables_removed():
    """For the duration of a launch: without the variables that break a multi-process
    spawn, put back after."""
    saved = spawn_breaking_variables()
    for name in saved:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(saved)
