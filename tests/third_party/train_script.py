"""A TPU training script written for torch_xla only: torch_xla.launch with its default
start method (spawn), data parallel SGD, a collective, arguments on the command line."""

import argparse

import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr


def train(index, lr, steps):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(index)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data).to(device)
        loss = ((model(x) - 1) ** 2).mean()
        loss.backward()
        xm.optimizer_step(optimizer)
    weights = xm.all_gather(model.weight.detach().view(1, -1)).cpu()
    same = bool((weights == weights[0]).all())
    xm.master_print(f"world size {xr.world_size()}, same weights on every core: {same}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3)
    options = parser.parse_args()
    torch_xla.launch(train, args=(options.lr, options.steps))
