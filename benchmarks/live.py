"""The live view's cost, on 8 simulated cores, as ratios measured in the same run.

The same training (3 epochs of the shared workload) is timed inside the ranks, seconds
a step after the warm-up, in a real Jupyter kernel (nbclient acting as the front end):

- off: the same values computed and kept in a list, no tpunb.log, live=False;
- text: tpunb.log(loss=..., accuracy=...) every step, live="text" (a line an epoch);
- widgets: the same logging, live="widgets" (progress line and live figure).

Target: text and widgets at most 1.03 times off. Runs alternate between the sides so
drift on the machine hits all alike; figures are medians over the repeats.
Run: python benchmarks/live.py [--repeats N]
"""

import argparse
import json
import pathlib

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent

SETUP = """
import json, statistics, sys, time
sys.path.insert(0, {here!r})
import torch, tpunb
from torch.utils.data import DataLoader
from workload import BATCH, DATASET, MODEL
tpunb.simulate(cores=8)
loader = DataLoader(DATASET, batch_size=BATCH, shuffle=True)

def train(rank, log, epochs=3, warmup=5):
    import copy
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    model = copy.deepcopy(MODEL).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sharded = tpunb.shard(loader)
    steps, start, kept = 0, None, []
    for _ in range(epochs):
        for x, y in sharded:
            if steps == warmup:
                xm.wait_device_ops()
                start = time.perf_counter()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            xm.optimizer_step(optimizer)
            optimizer.zero_grad()
            accuracy = (logits.argmax(1) == y).float().mean()
            if log:
                tpunb.log(loss=loss, accuracy=accuracy)
            else:  # the same values computed and kept, as a notebook without tpunb would
                kept.append((loss.detach(), accuracy))
            steps += 1
    xm.wait_device_ops()
    return (time.perf_counter() - start) / (steps - warmup)

SIDES = {{"off": (False, False), "text": (True, "text"), "widgets": (True, "widgets")}}
seconds = {{side: [] for side in SIDES}}
"""

RUN = """
for _ in range({repeats}):
    for side, (log, live) in SIDES.items():
        per_rank = tpunb.launch(train, log, live=live)
        seconds[side].append(statistics.median(per_rank))
print("RESULT", json.dumps(seconds))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    cells = [SETUP.format(here=str(HERE)), RUN.format(repeats=repeats)]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(notebook, timeout=3600, kernel_name="python3").execute()
    printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
    seconds = json.loads(printed.split("RESULT ", 1)[1].splitlines()[0])

    medians = {side: sorted(runs)[len(runs) // 2] for side, runs in seconds.items()}
    print(f"8 simulated cores, {repeats} runs a side, seconds a step timed in the ranks")
    for side, median in medians.items():
        print(f"  {side:8} {median * 1000:7.2f} ms a step (median)")
    for side in ("text", "widgets"):
        ratio = medians[side] / medians["off"]
        print(f"live {side} against off: {ratio:.3f} (target at most 1.03)")


if __name__ == "__main__":
    main()
