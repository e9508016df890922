"""``pytest --tpunb-simulate=N``: TPU code and TPU notebooks tested on N simulated cores.

A pytest plugin, registered by tpunb's ``pytest11`` entry point: installed with tpunb, it
is there in every pytest run. Without the option it only adds, to a notebook cell that
fails under nbval, what the cell printed: nbval names an output stream the saved cell
lacks ("Unexpected output fields: {'stderr'}") but not its text. With the option:

- the test process simulates N TPU cores before any test runs (``tpunb.simulate``), so
  tests that call ``xmp.spawn`` or ``torch_xla.launch`` run their ranks on them;
- every notebook that nbval executes (``pytest --nbval``) gets a kernel that simulates N
  cores before its first cell, so a notebook written for Kaggle's or Colab's TPU, which
  never heard of tpunb, runs unchanged: CI for TPU notebooks;
- a notebook as it is often saved runs: a cell with outputs but no execution count (run
  alone after the others, or exported so by a notebook service) runs like the others
  where nbval would not compare its outputs anyway (``--nbval-lax``);
- the plain launches (``xmp.spawn``, ``torch_xla.launch``) of the tests and notebooks are
  watched, and the session ends with tpunb's report of what a TPU would meet
  (``simulation/pitfalls.py``).
"""

import contextlib

import pytest

from tpunb import notebook_run


def pytest_addoption(parser):
    group = parser.getgroup("tpunb", "TPU cores simulated on the CPU (tpunb)")
    group.addoption(
        "--tpunb-simulate",
        metavar="N",
        type=int,
        default=None,
        help="simulate N TPU cores on the CPU, in the tests and in every notebook kernel "
        "nbval starts (--nbval), with the real torch_xla",
    )
    group.addoption(
        "--tpunb-instead-of-tpu",
        action="store_true",
        help="with --tpunb-simulate: simulate even on a machine with a TPU",
    )


def pytest_configure(config):
    cores = config.getoption("tpunb_simulate")
    if cores is None:
        return
    from tpunb.errors import TpunbError
    from tpunb.simulation import pitfalls, simulate

    # The report's folder, named in the environment before the simulation and nbval's
    # kernels start: the plain launches of the tests and of the notebooks' cells are
    # watched for it, and it is printed at the end (pytest_terminal_summary).
    report = config.stash[_REPORT] = contextlib.ExitStack()
    config.stash[_REPORT_FOLDER] = report.enter_context(pitfalls.folder())
    config.add_cleanup(report.close)
    try:
        simulate(
            cores=cores,
            instead_of_tpu=config.getoption("tpunb_instead_of_tpu"),
        )
    except TpunbError as error:
        raise pytest.UsageError(f"--tpunb-simulate={cores}: {error}") from None


def pytest_collection_modifyitems(config, items):
    """nbval refuses a cell saved with outputs but no execution count ("Unrun reference
    cell has outputs"), though it never compares an unrun cell's outputs. Where it would not
    compare them in any case (``--nbval-lax``, a cell not marked ``NBVAL_CHECK_OUTPUT``),
    the saved outputs are set aside and the cell runs as the notebook's kernel would run it.
    Cells whose outputs nbval compares keep nbval's error."""
    if config.getoption("tpunb_simulate") is None:
        return
    ran = 0
    for item in items:
        cell, options = getattr(item, "cell", None), getattr(item, "options", None)
        if not isinstance(options, dict) or options.get("check", True) or cell is None:
            continue
        if cell.get("execution_count") is None and cell.get("outputs"):
            cell["outputs"] = []
            ran += 1
    config.stash[_UNRUN_CELLS] = ran


_UNRUN_CELLS = pytest.StashKey[int]()


_REPORT = pytest.StashKey[contextlib.ExitStack]()
_REPORT_FOLDER = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, config):
    folder = config.stash.get(_REPORT_FOLDER, None)
    if folder is not None:
        from tpunb.simulation import pitfalls

        terminalreporter.section("tpunb: what a TPU would meet")
        for line in pitfalls.report_lines(*pitfalls.report(folder)):
            terminalreporter.write_line(line)
    ran = config.stash.get(_UNRUN_CELLS, 0)
    if ran:
        terminalreporter.write_line(
            f"tpunb: {ran} cell(s) saved with outputs but no execution count ran; under "
            "--nbval-lax their saved outputs are not compared."
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A cell nbval ran and failed: each stream it printed, as a section of the report."""
    outcome = yield
    report = outcome.get_result()
    printed = getattr(item, "test_outputs", None)  # nbval's cell item, once it has run
    if report.failed and call.when == "call" and printed:
        for output in printed:
            if output.get("output_type") == "stream":
                report.sections.append((f"the cell's {output['name']}", output["text"]))


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item):
    """After nbval has started a notebook's kernel, and before its first cell: simulate."""
    cores = item.config.getoption("tpunb_simulate")
    notebook = item.parent
    kernel = getattr(notebook, "kernel", None)
    if cores is None or kernel is None or getattr(notebook, "tpunb_simulated", None) is kernel:
        return
    code = notebook_run.SIMULATE_IN_KERNEL.format(
        cores=cores,
        instead_of_tpu=item.config.getoption("tpunb_instead_of_tpu"),
    )
    error = _run_in_kernel(kernel, code)
    if error:
        pytest.fail(f"--tpunb-simulate={cores} failed in the notebook's kernel: {error}")
    notebook.tpunb_simulated = kernel


def _run_in_kernel(kernel, code, timeout=300):
    """Runs ``code`` in nbval's kernel (its client blocks), with no output; returns its
    error text, if any."""
    message_id = kernel.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
    while True:
        reply = kernel.kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == message_id:
            break
    content = reply["content"]
    if content["status"] == "ok":
        return None
    return f"{content.get('ename')}: {content.get('evalue')}"
