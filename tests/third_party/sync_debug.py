"""A TPU script written for torch_xla only, run with PT_XLA_DEBUG_LEVEL=2 to find what
makes it compile and execute: each step ends with the user's own torch_xla.sync()."""

import torch
import torch_xla


def train(index):
    device = torch_xla.device()
    weights = torch.ones(4, device=device)
    for _ in range(3):
        weights = weights * 0.5 + 1
        torch_xla.sync()  # the step's end: "user torch_xla.sync"


if __name__ == "__main__":
    torch_xla.launch(train)
