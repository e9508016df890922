"""What tpunb's report costs (python -m tpunb.simulate, pytest --tpunb-simulate), on 8
simulated cores, as a ratio measured in the same run.

The report watches each plain launch's ranks (tpunb/simulation/pitfalls.py): their steps
are recorded to files, the first batch of each pass over a DataLoader is fingerprinted, and
the launching process judges them once the ranks have ended. The same data-parallel epoch
(benchmarks/launch.py's, launched with a bare xmp.spawn) runs alternately without the report
and with it, with nothing to find (target: nothing measurable, within noise of 1.00).

The DataLoader notes stay in place on both sides once installed (``simulate`` installs them
where the report is on); what they add to a batch when no launch is watched is timed
alone, against the batch itself.

Run: python benchmarks/report.py [--repeats N]
"""

import argparse
import os
import statistics
import time

from launch import compare, epoch
from torch.utils.data import DataLoader
from workload import BATCH, DATASET, SAMPLES

import tpunb
from tpunb.simulation import pitfalls


def plain_launch():
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(epoch, start_method="fork")


def reported(folder):
    def launch():
        os.environ[pitfalls.FOLDER] = folder
        try:
            plain_launch()
        finally:
            del os.environ[pitfalls.FOLDER]

    return launch


def per_batch(repeats=5):
    """Median seconds of a pass over the epoch's loader, without the notes and with them."""
    from torch.utils.data import dataloader

    from tpunb.upstream import patching

    def one_pass():
        start = time.perf_counter()
        for _ in DataLoader(DATASET, batch_size=BATCH):
            pass
        return time.perf_counter() - start

    noted = [one_pass() for _ in range(repeats)]
    owners = (DataLoader, dataloader._BaseDataLoaderIter)
    originals = {
        (owner, name): patching.upstream(getattr(owner, name))
        for owner in owners
        for name in ("__init__", "__next__")
        if name in vars(owner)
    }
    saved = {key: getattr(*key) for key in originals}
    for (owner, name), original in originals.items():
        setattr(owner, name, original)
    try:
        plain = [one_pass() for _ in range(repeats)]
    finally:
        for (owner, name), current in saved.items():
            setattr(owner, name, current)
    return statistics.median(plain), statistics.median(noted)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    with pitfalls.folder() as folder:
        tpunb.simulate(cores=8)  # the report is on: with its DataLoader notes installed
        del os.environ[pitfalls.FOLDER]  # on again only for the reported side's launches
        steps = SAMPLES // 8 // BATCH
        sides = {"no report": plain_launch, "report": reported(folder)}
        compare(f"data-parallel epoch ({steps} steps)", sides, repeats, 1.00)
        launches, findings = pitfalls.report(folder)
        print(f"the report watched {launches} launches and found {len(findings)} things")
    plain, noted = per_batch()
    batches = -(-SAMPLES // BATCH)
    print(
        f"a pass over the loader ({batches} batches), no launch watched: "
        f"{plain * 1e3:.1f} ms plain, {noted * 1e3:.1f} ms with the notes "
        f"({(noted - plain) / batches * 1e6:+.2f} us a batch)"
    )


if __name__ == "__main__":
    main()
