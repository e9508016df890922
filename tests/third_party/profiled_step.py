"""A TPU training script written for torch_xla only, whose steps are annotated for
torch_xla's profiler the documented way (``xp.StepTrace``, ``xp.Trace``), with the
gradients' all-reduce inside the trace."""

import torch
import torch.nn as nn
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.profiler as xp
import torch_xla.runtime as xr


def train(index):
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(index)
    for step in range(3):
        with xp.StepTrace("train_step", step_num=step):
            with xp.Trace("build_graph"):
                x = torch.randn(16, 4, generator=data).to(device)
                loss = ((model(x) - 1) ** 2).mean()
                loss.backward()
                xm.optimizer_step(optimizer)
    weights = xm.all_gather(model.weight.detach().view(1, -1)).cpu()
    same = bool((weights == weights[0]).all())
    xm.master_print(f"{xr.world_size()} cores, 3 traced steps, same weights: {same}")


if __name__ == "__main__":
    torch_xla.launch(train)
