"""The training workload the benchmarks share: data and a model built before any launch,
so the fork shares them with every core."""

import torch
from torch.utils.data import TensorDataset

SAMPLES, FEATURES, BATCH = 16384, 64, 32

_generator = torch.Generator().manual_seed(0)
DATASET = TensorDataset(
    torch.randn(SAMPLES, FEATURES, generator=_generator),
    torch.randint(0, 10, (SAMPLES,), generator=_generator),
)
torch.manual_seed(0)
MODEL = torch.nn.Sequential(
    torch.nn.Linear(FEATURES, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
)
