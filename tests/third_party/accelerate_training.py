"""Hugging Face Accelerate in a Kaggle TPU notebook, written for Accelerate only: a
training function launched by notebook_launcher (Accelerate is in Kaggle's TPU image)."""

import torch
from accelerate import Accelerator, notebook_launcher


def training_function():
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.full((8, 4), accelerator.process_index + 1.0, device=accelerator.device)
    loss = model(x).sum()
    accelerator.backward(loss)
    optimizer.step()
    accelerator.wait_for_everyone()
    weights = accelerator.gather(model.weight.detach()).cpu()
    accelerator.print(
        f"{accelerator.distributed_type} on {accelerator.num_processes} processes, "
        f"same weights: {bool((weights == weights[0]).all())}"
    )
    print(
        f"process {accelerator.process_index}, local {accelerator.local_process_index}, "
        f"main {accelerator.is_main_process}",
        flush=True,
    )


def main():
    training_function()


if __name__ == "__main__":
    notebook_launcher(training_function, ())
