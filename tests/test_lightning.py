"""PyTorch Lightning on 8 simulated cores: Lightning's own XLA strategy, fork launcher and
sampler, checked against tpunb.launch + shard() on the same batches."""

import copy
import logging
import pathlib
import re
import warnings

import pytest
import torch
from conftest import run_python
from torch.utils.data import DataLoader, Dataset

import tpunb

lightning = pytest.importorskip("lightning")
import tpunb.lightning  # noqa: E402 - needs lightning

CORES, SAMPLES, BATCH, LR = 8, 512, 8, 0.05  # 8 steps an epoch


class Indexed(Dataset):
    """(index, inputs, target): the ranks report which samples they read."""

    def __init__(self):
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(SAMPLES, 16, generator=generator)
        self.targets = self.inputs[:, :4].sum(dim=1, keepdim=True)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return index, self.inputs[index], self.targets[index]


def _network():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


class Regression(lightning.LightningModule):
    def __init__(self, network, seen_dir=None, fail_on_rank=None):
        super().__init__()
        self.network = copy.deepcopy(network)
        self.seen_dir = seen_dir
        self.fail_on_rank = fail_on_rank
        self.seen = []

    def training_step(self, batch, batch_index):
        if self.global_rank == self.fail_on_rank and batch_index == 2:
            raise ValueError("the data of this core is broken")
        indices, inputs, targets = batch
        if self.seen_dir is not None:
            self.seen.extend(indices.cpu().tolist())  # data from the loader: no graph to run
        loss = torch.nn.functional.mse_loss(self.network(inputs), targets)
        self.log("mse", loss)
        return loss

    def validation_step(self, batch, batch_index):
        indices, inputs, targets = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self.network(inputs), targets))

    def on_train_end(self):
        if self.seen_dir is not None:
            (self.seen_dir / f"rank{self.global_rank}.txt").write_text(
                " ".join(map(str, self.seen))
            )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _quiet(tmp_path):
    return dict(
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )


def _train_through_shard(rank, network, loader, epochs):
    import torch_xla
    import torch_xla.core.xla_model as xm

    network = copy.deepcopy(network).to(torch_xla.device())
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    sharded = tpunb.shard(loader)
    for _ in range(epochs):
        for _, inputs, targets in sharded:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(network(inputs), targets).backward()
            xm.optimizer_step(optimizer)
    return network.state_dict()


def _reference(network, epochs):
    """The same training through tpunb.launch and shard(), on the same batches: Lightning's
    sampler shuffles the training data (seed PL_GLOBAL_SEED, default 0) even when the
    loader does not, so the reference loader shuffles with seed 0."""
    loader = DataLoader(
        Indexed(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    return tpunb.launch(_train_through_shard, network, loader, epochs, live=False)[0]


def _assert_trained_like(module, reference, initial):
    for name, tensor in module.network.state_dict().items():
        assert not torch.equal(tensor, initial.state_dict()[name]), f"{name} did not train"
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-5)


def test_a_plain_trainer_fits_on_8_simulated_cores_with_lightnings_sampler(cores8, tmp_path):
    network = _network()
    model = Regression(network, seen_dir=tmp_path)
    trainer = lightning.Trainer(accelerator="tpu", devices=8, max_epochs=1, **_quiet(tmp_path))
    assert type(trainer.strategy).__name__ == "XLAStrategy"
    assert trainer.num_devices == CORES

    trainer.fit(model, DataLoader(Indexed(), batch_size=BATCH))

    seen = [(tmp_path / f"rank{r}.txt").read_text().split() for r in range(CORES)]
    assert [len(indices) for indices in seen] == [SAMPLES // CORES] * CORES
    assert sorted(int(i) for indices in seen for i in indices) == list(range(SAMPLES))
    # The notebook's model holds the trained weights, equal to tpunb.launch + shard().
    _assert_trained_like(model, _reference(network, epochs=1), network)


def test_devices_auto_means_every_simulated_core(cores8, tmp_path):
    trainer = lightning.Trainer(accelerator="tpu", devices="auto", **_quiet(tmp_path))
    assert trainer.num_devices == CORES


def test_the_live_callback_feeds_history_compile_watch_and_text_view(cores8, tmp_path, capsys):
    network = _network()
    model = Regression(network)
    live = tpunb.lightning.LiveCallback()
    trainer = tpunb.lightning.trainer(
        max_epochs=2, callbacks=[live], live="text", **_quiet(tmp_path)
    )
    validation = DataLoader(Indexed(), batch_size=2 * BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(Indexed(), batch_size=BATCH), validation)

    history = live.history
    assert history.ranks == CORES
    training = [s for s in history.steps[0] if s.epoch == 0 and "loss" in s.values]
    assert [s.epoch_batch for s in training] == list(range(1, SAMPLES // CORES // BATCH + 1))
    assert all(s.epoch_batches == SAMPLES // CORES // BATCH for s in training)
    assert all(s.values["loss"] == pytest.approx(s.values["mse"]) for s in training)
    assert all(s.shapes for s in training)  # each loss in the step of its batch, which computed it
    assert not any("val_mse" in s.values for s in history.steps[0])  # training metrics only
    # Lightning's setup, its second batch, its validation and its epoch ends compile:
    # none of that is the notebook's doing, so the watch counts it and warns about nothing.
    assert live.compiles.compiles > 0
    assert live.compiles.causes == []
    assert [w for w in caught if issubclass(w.category, tpunb.TpunbWarning)] == []
    # Nor does the figure draw them as the training step's own ("later", red).
    per_step = history.compiles_per_step()
    assert [at for at in per_step if at.compiles > at.warmup + at.not_training] == []
    output = capsys.readouterr().out
    assert "epoch 1: 8 batches a core, loss" in output
    assert "done: epoch 2, batch 8/8" in output
    _assert_trained_like(model, _reference(network, epochs=2), network)


class ProgressBarRegression(Regression):
    def training_step(self, batch, batch_index):
        _, inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.network(inputs), targets)
        self.log("mse", loss, prog_bar=True)
        return loss


def test_a_value_logged_for_the_progress_bar_is_recorded_without_a_read_of_its_own(
    cores8, tmp_path
):
    live = tpunb.lightning.LiveCallback()
    trainer = tpunb.lightning.trainer(
        max_epochs=2, callbacks=[live], live=False, **_quiet(tmp_path)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(ProgressBarRegression(_network()), DataLoader(Indexed(), batch_size=BATCH))
    # Lightning reads the value after the step's sync: no cut. Where the execution was still
    # computing it, the host waited: named with Lightning's line and the fix.
    for warning in caught:
        if issubclass(warning.category, tpunb.TpunbWarning):
            assert re.search(r"has waited for the device .* prog_bar=True", str(warning.message))
    batches = 2 * SAMPLES // CORES // BATCH
    training = [s for s in live.history.steps[0] if "loss" in s.values]
    assert len(training) == batches
    assert all(s.values["mse"] == pytest.approx(s.values["loss"]) for s in training)
    # Lightning turns prog_bar values into numbers (.item()) once a batch, in its logger
    # connector's on_batch_end: the warning names it. Reading trainer.callback_metrics, the
    # callback did it again.
    reads = live.compiles.fallbacks.get("aten::_local_scalar_dense", 0)
    assert reads <= CORES * batches


class GradientNormRegression(Regression):
    def on_before_optimizer_step(self, optimizer):
        self.log("gradient_norm", torch.linalg.vector_norm(self.network[0].weight.grad))


def test_a_value_logged_after_the_training_step_joins_its_batchs_loss(cores8, tmp_path):
    live = tpunb.lightning.LiveCallback()
    trainer = tpunb.lightning.trainer(
        max_epochs=1, callbacks=[live], live=False, **_quiet(tmp_path)
    )
    trainer.fit(GradientNormRegression(_network()), DataLoader(Indexed(), batch_size=BATCH))
    for steps in live.history.steps.values():
        with_loss = [s.step for s in steps if "loss" in s.values]
        assert len(with_loss) == SAMPLES // CORES // BATCH
        assert [s.step for s in steps if "gradient_norm" in s.values] == with_loss
        assert all(s.values["gradient_norm"] > 0 for s in steps if "gradient_norm" in s.values)


def test_fit_again_needs_a_new_trainer_and_continues_from_the_trained_weights(
    cores8, tmp_path, caplog
):
    network = _network()
    model = Regression(network)
    with caplog.at_level(logging.INFO):
        trainer = tpunb.lightning.trainer(max_epochs=1, live=False, **_quiet(tmp_path))
        trainer.fit(model, DataLoader(Indexed(), batch_size=BATCH))
    # Lightning's INFO lines (the hardware found, a tip, "fit stopped") add nothing to a run
    # tpunb shows; in a notebook each came twice.
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == []
    with pytest.raises(tpunb.TpunbError, match="cannot fit the same Trainer twice"):
        trainer.fit(model, DataLoader(Indexed(), batch_size=BATCH))

    again = tpunb.lightning.trainer(max_epochs=1, live=False, **_quiet(tmp_path))
    again.fit(model, DataLoader(Indexed(), batch_size=BATCH))
    # Plain SGD keeps no state, and each fit starts the sampler at epoch 0 again: two
    # fits are two launches of one epoch.
    once = copy.deepcopy(network)
    once.load_state_dict(_reference(network, epochs=1))
    _assert_trained_like(model, _reference(once, epochs=1), network)


def test_a_failing_rank_stops_the_run_with_its_traceback(cores8, tmp_path, no_children_left):
    model = Regression(_network(), fail_on_rank=3)
    trainer = tpunb.lightning.trainer(max_epochs=1, live=False, **_quiet(tmp_path))
    with pytest.raises(tpunb.RankError, match="rank 3 raised ValueError: the data of this core"):
        trainer.fit(model, DataLoader(Indexed(), batch_size=BATCH))


@pytest.mark.parametrize(
    ("arguments", "current"),
    [
        ({"tpu_cores": 8}, 'accelerator="tpu", devices=8'),
        ({"strategy": "tpu_spawn"}, 'strategy="xla"'),
    ],
)
def test_old_trainer_arguments_are_answered_with_the_current_spelling(cores8, arguments, current):
    with pytest.raises(tpunb.TpunbError, match=current.replace("(", r"\(")):
        tpunb.lightning.trainer(**arguments)


def test_one_core_is_refused_before_it_starts_the_runtime_in_the_notebook(cores8):
    with pytest.raises(tpunb.TpunbError, match="Leave devices out"):
        tpunb.lightning.trainer(devices=1)


@pytest.mark.pair("colab", reason="Colab's TPU is the one-core one")
def test_on_one_core_as_on_colab_the_rank_trains_in_a_child_and_the_kernel_can_launch_again(
    tmp_path,
):
    result = run_python(
        f"""
        import pathlib, sys
        sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
        import tpunb
        tpunb.simulate(cores=1)
        from torch.utils.data import DataLoader
        import test_lightning as t
        import tpunb.lightning

        network = t._network()
        model = t.Regression(network)
        trainer = tpunb.lightning.trainer(max_epochs=1, live=False, **t._quiet({str(tmp_path)!r}))
        print(type(trainer.strategy).__name__, trainer.num_devices)
        trainer.fit(model, DataLoader(t.Indexed(), batch_size=t.BATCH))
        print("XLA runtime started here:", tpunb.env().runtime_started)
        t._assert_trained_like(model, t._reference(network, epochs=1), network)  # a launch
        print("trained as tpunb.launch + shard train on 1 core")
        """,
        timeout=300,
    )
    assert result.stdout.splitlines() == [
        "OneCoreXLAStrategy 1",
        "XLA runtime started here: False",
        "trained as tpunb.launch + shard train on 1 core",
    ], result.stderr


def _old_tutorial(rank):
    import torch_xla.core.xla_model as xm

    return xm.xrt_world_size()


def test_a_removed_torch_xla_call_in_a_rank_gets_its_current_spelling(cores8):
    with pytest.raises(tpunb.RankError, match=r"Write torch_xla\.runtime\.world_size\(\) instead"):
        tpunb.launch(_old_tutorial, live=False)


@pytest.mark.parametrize(
    "lightning_first",
    [  # the same Lightning on both pairs: each import order on one (CI time)
        pytest.param(True, marks=pytest.mark.pair("colab", reason="the other order on Kaggle's")),
        pytest.param(False, marks=pytest.mark.pair("kaggle", reason="the other order on Colab's")),
    ],
)
def test_simulate_opens_lightning_to_the_simulated_cores_in_either_import_order(lightning_first):
    imports = ["import lightning", "import tpunb; tpunb.simulate(cores=4)"]
    result = run_python(
        "\n".join([*(imports if lightning_first else imports[::-1]), _DEVICE_COUNT]), timeout=240
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "4"]


_DEVICE_COUNT = """
from lightning.pytorch.accelerators import XLAAccelerator
print(XLAAccelerator.is_available(), XLAAccelerator.auto_device_count())
"""


@pytest.mark.pair("colab", reason="a machine without a TPU answers alike on both pairs")
def test_without_simulate_lightning_still_finds_no_tpu_here():
    result = run_python(
        "import tpunb, lightning\n"
        "from lightning.pytorch.accelerators import XLAAccelerator\n"
        "print(XLAAccelerator.is_available())\n"
        "try:\n"
        "    import tpunb.lightning; tpunb.lightning.trainer()\n"
        "except tpunb.TpunbError as error:\n"
        "    print(error)\n",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("False\nNo TPU found on this machine")
