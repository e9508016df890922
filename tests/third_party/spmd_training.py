"""SPMD as torch_xla's docs teach it (perf/spmd_basic.html and perf/fsdpv2.html in
https://docs.pytorch.org/xla/release/r2.9/): one process drives every device; a mesh over
the devices, tensors annotated with ``xs.mark_sharding``, and FSDPv2 wrapping a small
transformer. Trains a sharded linear model and the FSDPv2 transformer a few steps each,
then saves the weights before and after training to the path given. With --one-device,
the same training on one device without sharding: the reference."""

import sys

import numpy as np
import torch
import torch_xla
import torch_xla.runtime as xr

SPMD = "--one-device" not in sys.argv
if SPMD:
    xr.use_spmd()

import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

STEPS = 4


def _train(model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        torch_xla.sync()


def main(path):
    device = torch_xla.device()
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=generator), torch.randn(32, 4, generator=generator))]
    data *= STEPS
    sequences = [
        (torch.randn(16, 8, 32, generator=generator), torch.randn(16, 8, 32, generator=generator))
    ] * STEPS

    torch.manual_seed(0)
    linear = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    ).to(device)
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
    ).to(device)

    batches = [(x.to(device), y.to(device)) for x, y in data]
    sequence_batches = [(x.to(device), y.to(device)) for x, y in sequences]
    if SPMD:
        devices = xr.global_runtime_device_count()
        print(f"devices {devices} {xr.device_type()}", flush=True)
        # The linear model: the batch split along 'data', the hidden layer along 'model'.
        mesh = xs.Mesh(np.arange(devices), (devices // 2, 2), ("data", "model"))
        xs.mark_sharding(linear[0].weight, mesh, ("model", None))
        xs.mark_sharding(linear[2].weight, mesh, (None, "model"))
        for inputs, targets in batches:
            xs.mark_sharding(inputs, mesh, ("data", None))
            xs.mark_sharding(targets, mesh, ("data", None))
        # FSDPv2: the parameters and the batch split along 'fsdp'.
        fsdp_mesh = xs.Mesh(np.arange(devices), (devices, 1), ("fsdp", "tensor"))
        layer = FSDPv2(layer, mesh=fsdp_mesh)
        for inputs, targets in sequence_batches:
            xs.mark_sharding(inputs, fsdp_mesh, ("fsdp", None, None))
            xs.mark_sharding(targets, fsdp_mesh, ("fsdp", None, None))
        spec = torch_xla._XLAC._get_xla_sharding_spec(linear[0].weight)
        print(f"linear[0].weight sharding {spec}", flush=True)
    module = layer.module if SPMD else layer
    initial = {f"linear.{k}": v.cpu() for k, v in linear.state_dict().items()}
    initial.update({f"layer.{k}": v.cpu() for k, v in module.state_dict().items()})
    _train(linear, batches)
    _train(layer, sequence_batches)
    weights = {
        **{f"linear.{k}": v.cpu() for k, v in linear.state_dict().items()},
        **{f"layer.{k}": v.cpu() for k, v in module.state_dict().items()},
    }
    torch.save({"initial": initial, "trained": weights}, path)


if __name__ == "__main__":
    main(sys.argv[1])
