"""A user's typed notebook code: every public name of tpunb, called as documented."""

import torch
from torch.utils.data import DataLoader, TensorDataset

import tpunb
import tpunb.lightning


def train(rank: int, lr: float) -> float:
    loader = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
    for (batch,) in tpunb.shard(loader):
        tpunb.log(loss=batch.sum())
    step = tpunb.limit_graphs(lambda x: x, 4)
    return lr * rank + float(step(1.0))


def main() -> None:
    report: tpunb.Environment = tpunb.env()
    cores: int = report.cores
    tpunb.simulate(cores=8)
    loader = DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2)
    tpunb.batch_report(loader, cores=cores)
    results: tpunb.LaunchResults = tpunb.launch(train, 0.1)
    first: float = results[0]
    summary: tpunb.CompileSummary = results.compiles
    history: tpunb.History = results.history
    print(first, summary.compiles, history.names())
    print(tpunb.global_batch_size(loader, cores), tpunb.per_core_batch_size(16, cores))
    print(tpunb.scale_learning_rate(0.1, 8, 64))
    buckets: list[int] = tpunb.choose_buckets([3, 5, 9], 2, batch_size=2)
    collate = tpunb.BucketCollate(buckets)
    print(collate, tpunb.sweep_batch_sizes)
    trainer = tpunb.lightning.trainer(max_epochs=1)
    callback = tpunb.lightning.LiveCallback()
    print(trainer, callback)
