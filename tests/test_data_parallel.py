"""Data parallelism on 8 simulated cores equals single-device training on the global batch."""

import copy

import pytest
import torch
from conftest import in_forked_process
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tpunb

CORES, SAMPLES, BATCH, EPOCHS = 8, 1024, 16, 2
OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}


def _problem():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, 16, generator=generator)
    targets = inputs[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(
        SAMPLES, 1, generator=generator
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return TensorDataset(inputs, targets), model


def _train_on_every_core(rank, model, dataset, optimizer, shuffle):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    device = torch_xla.device()
    # Each rank takes its own copy of the model built before the launch, as torch_xla's
    # examples do (on a TPU v2/v3 two ranks shared a process, and so the model).
    model = copy.deepcopy(model).to(device)
    sampler = DistributedSampler(
        dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=shuffle, seed=7
    )
    loader = MpDeviceLoader(DataLoader(dataset, batch_size=BATCH, sampler=sampler), device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            xm.optimizer_step(opt)
    return model.state_dict()


def _train_on_one_device(model, dataset, optimizer, shuffle):
    """The same steps on the CPU, each on the 8 per-core batches concatenated."""
    model = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](model.parameters())
    samplers = [
        DistributedSampler(dataset, num_replicas=CORES, rank=r, shuffle=shuffle, seed=7)
        for r in range(CORES)
    ]
    for epoch in range(EPOCHS):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), BATCH):
            indices = [i for shard in shards for i in shard[start : start + BATCH]]
            inputs, targets = dataset[indices]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_8_cores_match_single_device_training_on_the_global_batch(cores8, optimizer):
    dataset, model = _problem()
    states = tpunb.launch(_train_on_every_core, model, dataset, optimizer, shuffle=False)
    reference = in_forked_process(_train_on_one_device, model, dataset, optimizer, False)
    _assert_replicas_equal_reference(states, reference, model)


def test_shuffled_epochs_match_too(cores8):
    dataset, model = _problem()
    states = tpunb.launch(_train_on_every_core, model, dataset, "Adam", shuffle=True)
    reference = in_forked_process(_train_on_one_device, model, dataset, "Adam", True)
    _assert_replicas_equal_reference(states, reference, model)


def _assert_replicas_equal_reference(states, reference, initial):
    assert len(states) == CORES
    for state in states[1:]:
        for name, tensor in state.items():
            assert torch.equal(tensor, states[0][name]), f"{name} differs between ranks"
    for name, tensor in states[0].items():
        assert not torch.allclose(tensor, initial.state_dict()[name]), f"{name} did not train"
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5)
