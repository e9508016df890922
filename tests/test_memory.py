"""tpunb.memory measures what a replica holds on a core and what a process holds on the
host: sizes checked against ones counted by hand."""

import torch

import tpunb.memory as memory


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _batch(size):
    return torch.randn(size, 64), torch.randint(0, 10, (size,))


def test_a_replica_holds_weights_gradients_adams_two_states_and_the_saved_activations():
    model = _model()
    report = memory.replica_memory(
        model, _batch(256), torch.optim.Adam, loss=torch.nn.functional.cross_entropy
    )
    weights = 4 * (64 * 512 + 512 + 512 * 10 + 10)
    assert report.weights == report.gradients == weights
    # exp_avg and exp_avg_sq for each parameter, and its step count (a float32 scalar).
    assert report.optimizer_state == 2 * weights + 4 * 4
    # Kept for backward: the input (256 x 64), ReLU's output (256 x 512), the softmax
    # (256 x 10) and the targets (256 int64), and the loss's scale (a float32 scalar).
    assert report.activations == 4 * (256 * 64 + 256 * 512 + 256 * 10) + 8 * 256 + 4
    assert all(p.grad is None for p in model.parameters())  # the model itself untouched


def test_bfloat16_autocast_halves_the_activations_and_keeps_bfloat16_weight_copies():
    model, batch = _model(), _batch(256)
    loss = torch.nn.functional.cross_entropy
    full = memory.replica_memory(model, batch, loss=loss)
    half = memory.replica_memory(model, batch, loss=loss, autocast=torch.bfloat16)
    assert (half.weights, half.gradients) == (full.weights, full.gradients)
    matmuls = 2 * (256 * 64 + 256 * 512)  # the second Linear's input and the ReLU's output
    assert full.activations - half.activations == matmuls
    assert half.cast_weights == 2 * 512 * 10  # the second Linear's weight, for its backward


def test_a_model_known_by_its_size_and_its_share_of_a_core():
    gpt2 = memory.replica_memory_of(124_000_000, name="GPT-2")
    assert gpt2.total == 16 * 124_000_000  # 4 bytes each: weight, gradient, 2 Adam states
    assert gpt2.fits("v5e") == gpt2.total / 2**34


def test_private_memory_grows_by_what_the_process_writes():
    before = memory.process_memory()
    block = bytearray(50 * 10**6)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    after = memory.process_memory()
    assert after.private - before.private >= 45 * 10**6
    assert after.rss >= after.pss >= after.private
