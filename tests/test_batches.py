"""Batch sizes across cores: the report, its warnings, and the conversions."""

import re
import statistics
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import tpunb


def _loader(samples=1000, batch_size=32, drop_last=False):
    return DataLoader(
        TensorDataset(torch.arange(samples)), batch_size=batch_size, drop_last=drop_last
    )


def test_1000_samples_batch_32_on_8_cores_keeping_the_short_last_batch():
    report = tpunb.batch_report(_loader(), cores=8)
    assert (report.global_batch, report.samples_per_core, report.padded) == (256, 125, 0)
    assert (report.steps_per_epoch, report.last_batch, report.dropped) == (4, 29, 0)
    (warning,) = report.warnings
    assert "last batch of every epoch has 29 samples, not 32" in warning
    assert "drop_last=True" in warning and "leaves out 232 samples" in warning


def test_1000_samples_batch_32_on_8_cores_with_drop_last():
    report = tpunb.batch_report(_loader(drop_last=True), cores=8)
    assert (report.global_batch, report.samples_per_core, report.padded) == (256, 125, 0)
    assert (report.steps_per_epoch, report.last_batch, report.dropped) == (3, 29, 232)
    assert report.warnings == ()
    assert "3 (last batch dropped: 29 samples a core)" in str(report)


def test_the_report_agrees_with_what_the_cores_really_read(cores8):
    loader = _loader(samples=1003, batch_size=24)
    report = tpunb.batch_report(loader)  # cores: the simulated 8
    assert (report.cores, report.padded, report.samples_per_core) == (8, 5, 126)

    def epoch(rank):
        return [len(batch[0]) for batch in tpunb.shard(loader)]

    (sizes,) = set(map(tuple, tpunb.launch(epoch)))
    assert len(sizes) == report.steps_per_epoch and sizes[-1] == report.last_batch == 6
    assert sum(sizes) * 8 == report.samples + report.padded


def test_a_batch_that_is_not_a_multiple_of_8_is_flagged_with_a_better_one():
    (warning,) = tpunb.batch_report(_loader(samples=960, batch_size=30), cores=8).warnings
    assert "per-core batch 30 is not a multiple of 8" in warning and "batch_size=32" in warning


def test_a_change_of_core_count_is_flagged_with_the_learning_rate_fix():
    loader = _loader(samples=1024)
    assert tpunb.batch_report(loader, cores=8).warnings == ()
    (warning,) = tpunb.batch_report(loader, cores=1).warnings
    assert "global batch changed from 256 (8 cores) to 32 (1 core)" in warning
    assert "scale_learning_rate(lr, from_batch=256, to_batch=32)" in warning
    assert "per_core_batch_size(256, cores=1)" in warning


def test_the_report_shows_as_text_and_as_a_table():
    report = tpunb.batch_report(_loader(), cores=8)
    assert "global batch           256 (32 x 8 cores)" in str(report)
    html = report._repr_html_()
    assert "<table>" in html and "256 (32 x 8 cores)" in html and "last batch" in html


def test_conversions_between_per_core_and_global_batch_and_the_learning_rate():
    assert tpunb.global_batch_size(32, cores=8) == 256
    assert tpunb.global_batch_size(_loader(), cores=8) == 256  # the loader's batch_size, 32
    with pytest.raises(tpunb.TpunbError, match="a DataLoader built with batch_size="):
        tpunb.global_batch_size(DataLoader(TensorDataset(torch.zeros(4)), batch_size=None))
    assert tpunb.per_core_batch_size(256, cores=8) == 32
    with pytest.raises(
        tpunb.TpunbError, match="does not split evenly over 8 cores; nearest that does: 96"
    ):
        tpunb.per_core_batch_size(100, cores=8)
    assert tpunb.scale_learning_rate(0.1, from_batch=32, to_batch=256) == pytest.approx(0.8)
    assert tpunb.global_batch_size(16, cores=tpunb.env().cores or 1) >= 16


def test_without_cores_to_count_the_error_says_what_to_pass():
    from conftest import run_python

    result = run_python(
        """
        import tpunb
        try:
            tpunb.global_batch_size(32)
        except tpunb.TpunbError as error:
            print(error)
        """
    )
    assert "pass cores=..., or call tpunb.simulate(cores=8) first" in result.stdout


def _mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def test_a_sweep_times_each_batch_size_on_every_core(cores8):
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(
        torch.randn(2048, 16, generator=generator), torch.randn(2048, 1, generator=generator)
    )
    model = torch.nn.Linear(16, 1)
    with warnings.catch_warnings():
        # Each batch size is a new shape on purpose: nothing to warn about.
        warnings.simplefilter("error", tpunb.TpunbWarning)
        sweep = tpunb.sweep_batch_sizes(model, dataset, [32, 8], _mse, steps=3, warmup=1)
    assert [(r.per_core_batch, r.global_batch, r.cores) for r in sweep.rows] == [
        (8, 64, 8),
        (32, 256, 8),
    ]
    for row in sweep.rows:
        assert len(row.rounds) == 3 and 0 < min(row.rounds)
        assert row.seconds_per_step == statistics.median(row.rounds)
        assert row.samples_per_second == pytest.approx(row.samples_per_second_per_core * 8)
        assert row.peak_memory is None  # the CPU device does not report memory
    text = str(sweep)
    assert "sweep on 8 cores simulated on the CPU" in text and "the CPU's speeds" in text
    assert "batch 8 a core" in text and "median of 3 rounds" in text and "not reported" in text


def test_a_sweep_on_too_little_data_says_so(cores8):
    dataset = TensorDataset(torch.randn(40, 16), torch.randn(40, 1))
    with pytest.raises(tpunb.RankError, match="fewer samples than one batch on every core"):
        tpunb.sweep_batch_sizes(torch.nn.Linear(16, 1), dataset, [8], _mse, steps=1, warmup=1)


def _memory_doubling_with_each_sample(model, batch):
    """A step whose memory doubles with every sample of the batch: 2 ** (3 * batch) numbers.
    From some size on, XLA cannot allocate it and says so (RESOURCE_EXHAUSTED), as a TPU
    does when its HBM runs out (here XLA's CPU client, refused by the host)."""
    inputs, targets = batch
    # Kept on the model until the step's sync, as activations are kept for the backward pass.
    model.kept = torch.ones(2 ** (3 * len(inputs)), device=inputs.device) * inputs.sum()
    return torch.nn.functional.mse_loss(model(inputs), targets)


def test_a_sweep_stops_at_the_first_size_that_runs_out_of_memory(cores8):
    dataset = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
    model = torch.nn.Linear(16, 1)
    sweep = tpunb.sweep_batch_sizes(
        model, dataset, [16, 2, 4, 14], _memory_doubling_with_each_sample, steps=2, warmup=1
    )
    assert [row.per_core_batch for row in sweep.rows] == [2, 4]  # 16 never tried
    size, error = sweep.did_not_fit
    assert size == 14 and "Out of memory allocating 1759" in error  # 2**42 floats
    assert re.search(r"batch 14 a core +does not fit in a core's memory: .*Out of mem", str(sweep))
    with pytest.raises(tpunb.TpunbError, match="smallest batch size, 14 a core, does not fit"):
        tpunb.sweep_batch_sizes(
            model, dataset, [14, 16], _memory_doubling_with_each_sample, steps=1, warmup=1
        )
