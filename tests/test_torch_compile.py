"""torch.compile(..., backend="openxla") inside the ranks of 8 simulated cores, every run."""

import torch

import tpunb

CORES = 8
RUNS = 50


def _compiled_collective(rank):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()

    def mean_of_column_sums(x, w):
        return xm.all_reduce(xm.REDUCE_SUM, (x @ w).relu().sum(0)) / CORES

    compiled = torch.compile(mean_of_column_sums, backend="openxla")
    w = torch.ones(4, 3, device=device)
    results = []
    for step in range(3):
        x = torch.full((2, 4), float(rank + step), device=device)
        results.append(compiled(x, w).tolist())
        torch_xla.sync()
    return results


def test_a_compiled_function_holding_a_collective_runs_every_time(cores8):
    # Rank r's column sums are 2 * 4 (r + step); their mean over the ranks is 28 + 8 step.
    expected = [[28.0 + 8 * step] * 3 for step in range(3)]
    for _ in range(RUNS):
        assert tpunb.launch(_compiled_collective, live=False) == [expected] * CORES
