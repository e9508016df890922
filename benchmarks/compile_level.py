"""XLA's CPU compile level on simulated cores: the level tpunb.simulate sets
(tpunb.simulation.COMPILE_LEVEL) against XLA's default (3), in the same run.

Two workloads, each side in its own Python process (each needs its own XLA runtime),
levels alternating so that drift on the machine hits both alike:

- compiling: one XLA CPU device trains simulation.py's MLP (64-512-512-10) with AdamW on
  batches of 12 sizes, a new graph each (as a learner's first epochs, or dynamic shapes,
  do): torch_xla's compile seconds (its CompileTime metric) and the process's CPU seconds
  in them.
- training: benchmarks/simulation.py's 8 simulated cores: the first epoch, which compiles,
  and an epoch after it (the median of the others).

Printed: medians of each side, and the level's ratio to the default.
Run: python benchmarks/compile_level.py [--repeats N]
"""

import argparse
import copy
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_LEVEL = 3  # XLA's own (DefaultDebugOptionsIgnoringFlags in xla/debug_options_flags.cc)


def compiling():
    """Compile seconds and CPU seconds of 12 new graphs on one XLA CPU device."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    sys.path.insert(0, str(HERE))
    from simulation import MODEL
    from workload import FEATURES

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch_xla.sync()
    xm.wait_device_ops()
    start = _cpu()
    for batch in range(8, 20):
        inputs = torch.randn(batch, FEATURES).to(device)
        labels = torch.randint(0, 10, (batch,)).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        torch_xla.sync()
    xm.wait_device_ops()
    return {"compile s": met.metric_data("CompileTime")[1] / 1e9, "CPU s": _cpu() - start}


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(level, workload):
    environ = dict(os.environ, XLA_FLAGS=f"--xla_backend_optimization_level={level}")
    if workload == "compiling":
        command = [sys.executable, __file__, "--compiling"]
    else:
        command = [sys.executable, str(HERE / "simulation.py"), "--side=simulated", "--epochs=4"]
    result = subprocess.run(command, capture_output=True, text=True, env=environ, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{workload} at level {level} failed:\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if workload == "compiling":
        return figures
    return {"first epoch s": figures[0], "later epoch s": statistics.median(figures[1:])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiling", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.compiling:
        print(json.dumps(compiling()))
        return
    from tpunb.simulation import COMPILE_LEVEL

    levels = (DEFAULT_LEVEL, COMPILE_LEVEL)
    runs = {(workload, level): [] for workload in ("compiling", "training") for level in levels}
    for _ in range(options.repeats):
        for workload, level in runs:
            runs[workload, level].append(_run(level, workload))
    print(f"\n{len(os.sched_getaffinity(0))} CPU(s), medians of {options.repeats} runs a side")
    level_name = f"level {COMPILE_LEVEL}"
    print(f"{'workload':<10} {'figure':<15} {'level 3':>8} {level_name:>8} {'ratio':>6}")
    for workload in ("compiling", "training"):
        for figure in runs[workload, DEFAULT_LEVEL][0]:
            base, level = (
                statistics.median(run[figure] for run in runs[workload, at]) for at in levels
            )
            print(f"{workload:<10} {figure:<15} {base:8.3f} {level:8.3f} {level / base:6.2f}")


if __name__ == "__main__":
    main()
