"""``python -m tpunb.simulate [--cores N] script.py [args]``: runs a TPU script unchanged on
N TPU cores simulated on the CPU; ``notebook.ipynb`` instead runs a TPU notebook, cell by
cell, in a Jupyter kernel that simulates them (notebook_run.py).

The script runs as ``python script.py [args]`` would run it, after ``tpunb.simulate(N)``:
its ``torch_xla.launch`` or ``xmp.spawn`` starts the ranks on the simulated cores, with
either start method (spawned children simulate the same cores, simulation/spawned.py).
``-m module`` runs a module instead, as ``python -m module`` would.
"""

import argparse
import os
import runpy
import sys
import traceback
import types

from tpunb import notebook_run, simulation
from tpunb.errors import TpunbError
from tpunb.simulation import pitfalls


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tpunb.simulate",
        description="Run a TPU script unchanged on TPU cores simulated on the CPU "
        "(the real torch_xla, on its CPU device).",
    )
    parser.add_argument("--cores", type=int, default=8, help="simulated cores (default: 8)")
    parser.add_argument(
        "--instead-of-tpu",
        action="store_true",
        help="simulate even on a machine with a TPU (on its CPU, far slower)",
    )
    parser.add_argument("-m", dest="module", help="run a module, as python -m does")
    parser.add_argument(
        "script",
        nargs="?",
        help="the script to run, as python would; or a notebook (.ipynb) to run cell by cell. "
        "Exit status: 0, it ran and the report found nothing; 4, it ran and the report "
        "found what a TPU would meet; 3, a cell raised (a script that raised: 1, or the status "
        "it exited with, as python's)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    argv = sys.argv[1:] if argv is None else list(argv)
    at = _module_option(argv)
    if at is None:
        options = parser.parse_args(argv)
    else:  # as python's own -m: every argument after "-m module" is the module's
        options = parser.parse_args(argv[: at + 2])
        options.args = argv[at + 2 :]
    if options.module is None and options.script is None:
        parser.error("give the script to run (or -m module)")
    if options.module is None and not os.path.isfile(options.script):
        parser.error(f"no such script: {options.script}")
    with pitfalls.folder() as report:
        if options.module is None and options.script.endswith(".ipynb"):
            if options.args:
                parser.error("a notebook takes no arguments")
            ran = notebook_run.run(options.script, options.cores, options.instead_of_tpu)
        else:
            ran = _run_program(parser, options)
        launches, findings = pitfalls.report(report)
        print("\n".join(pitfalls.report_lines(launches, findings)), flush=True)
    sys.exit(ran if ran != notebook_run.RAN or not findings else notebook_run.FOUND)


def _run_program(parser, options):
    """Runs the script or module on the simulated cores; returns RAN, or the exit status
    python would give it (1 where it raised, its own where it exited)."""
    try:
        simulation.simulate(cores=options.cores, instead_of_tpu=options.instead_of_tpu)
    except TpunbError as error:
        parser.exit(2, f"python -m tpunb.simulate: {error}\n")
    try:
        if options.module is not None:
            args = [options.script, *options.args] if options.script else options.args
            sys.argv = [options.module, *args]
            runpy.run_module(options.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [options.script, *options.args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
            runpy.run_path(options.script, run_name="__main__")
    except SystemExit as exit:
        if isinstance(exit.code, str):
            print(exit.code, file=sys.stderr)
        if exit.code not in (None, 0):
            return exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1  # as python's own, for an uncaught exception
    return notebook_run.RAN


def _module_option(argv):
    """Where "-m" stands among this command's own options, or None."""
    at = 0
    while at < len(argv):
        if argv[at] == "-m":
            return at
        if not argv[at].startswith("-"):
            return None  # the script: what follows is its own
        at += 2 if argv[at] == "--cores" else 1
    return None


class _Simulate(types.ModuleType):
    """``import tpunb.simulate`` makes this module the package's ``simulate``: it stays the
    function that simulates cores."""

    def __call__(self, *args, **kwargs):
        return simulation.simulate(*args, **kwargs)


sys.modules[__name__].__class__ = _Simulate

if __name__ == "__main__":
    main()
