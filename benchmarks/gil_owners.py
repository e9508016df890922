"""Whose Python holds the GIL in the rank threads of a Lightning fit on simulated cores.

The simulated ranks are threads of one process that meet at every collective, so the time
one rank holds the GIL delays every rank's step: a share of the GIL is a share of the
epoch, where a share of the CPU is not (XLA's own threads run without the GIL). This reads
py-spy's raw samples of GIL-holding threads, keeps those in Lightning's training loop, and
gives each sample to the innermost frame outside Python's standard library: tpunb's
launcher and LiveCallback code (torch_xla's metric reads it calls count as its), and
Lightning's callback dispatch (``_call_callback_hooks``, which runs once a hook a batch).
A share is where the GIL was held, not what caused it: C++ work that tpunb's held tensors
add to torch_xla's sync shows under the sync. Check a share by taking its code away in an
interleaved run (docs/simulation.md, "The py-spy shares misled").

Record (py-spy is not a dependency: pip install py-spy), then read:
    py-spy record --gil --subprocesses --rate 500 --format raw -o tpunb.txt -- \
        python benchmarks/lightning_vs_launch.py --one tpunb.lightning
    py-spy record ... -o lightning.txt -- python benchmarks/lightning_vs_launch.py --one lightning
    python benchmarks/gil_owners.py tpunb.txt lightning.txt
"""

import collections
import re
import sys

# Frames of Python's standard library: a sample in one belongs to its caller.
STANDARD_LIBRARY = re.compile(
    r"\((<frozen|<string>|threading\.py|queue\.py|multiprocessing/|pickle\.py|copyreg|"
    r"contextlib\.py|functools\.py|typing\.py|abc\.py|weakref|_weakrefset|dataclasses\.py|"
    r"concurrent/|selectors|socket\.py|logging/|enum\.py|collections/|inspect\.py|os\.py|"
    r"re/|traceback|linecache|tempfile|json/|statistics|copy\.py)"
)
TPUNB = re.compile(r"\(tpunb/(launcher|lightning\.py|history)")
METRICS = "torch_xla/debug/metrics.py"


def owners(path):
    """The training loop's GIL samples in the ranks, tpunb's by function, and Lightning's
    callback dispatch."""
    training, dispatch, tpunb = 0, 0, collections.Counter()
    with open(path) as samples:
        for line in samples:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any("training_epoch_loop.py" in frame for frame in frames):
                continue
            if not any("_XLALauncher._wrapping_function" in frame for frame in frames):
                continue
            training += int(count)
            outside = [frame for frame in frames if not STANDARD_LIBRARY.search(frame)]
            innermost = outside[-1]
            if METRICS in innermost and len(outside) > 1 and TPUNB.search(outside[-2]):
                innermost = outside[-2]
            if TPUNB.search(innermost):
                tpunb[innermost.partition(" (")[0]] += int(count)
            elif "_call_callback_hooks" in innermost:
                dispatch += int(count)
    return training, dispatch, tpunb


def main():
    for path in sys.argv[1:]:
        training, dispatch, tpunb = owners(path)
        if not training:
            print(f"{path}: no GIL sample in Lightning's training loop")
            continue
        own = sum(tpunb.values())
        print(
            f"{path}: {training} GIL samples in the training loop; tpunb's code {own} "
            f"({own / training:.1%}); Lightning's callback dispatch {dispatch} "
            f"({dispatch / training:.1%})"
        )
        for function, count in tpunb.most_common(12):
            print(f"  {count:6} {count / training:6.1%}  {function}")


if __name__ == "__main__":
    main()
