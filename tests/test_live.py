"""The live view: values logged in the ranks reach the notebook exactly, without a sync or
a transfer a step; text lines where no front end draws widgets; widgets and the final
figure from a real kernel; redraws at a bounded rate however fast the steps come."""

import base64
import io
import multiprocessing
import re
import time

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from torch.utils.data import DataLoader, TensorDataset

import tpunb
from tpunb.launcher import recorder
from tpunb.watch import live
from tpunb.watch.history import Step

EPOCHS, BATCHES = 3, 5  # a core's batches an epoch
DATA = TensorDataset(torch.arange(8 * BATCHES * 4, dtype=torch.float32)[:, None])


def _counting_steps(rank, loader, log):
    """Logs a device tensor and a Python number each batch, both known in advance."""
    import torch_xla
    import torch_xla.debug.metrics as met

    sharded = tpunb.shard(loader)
    start = time.monotonic()
    executions, transfers = met.counter_value("ExecuteComputation") or 0, _transfers(met)
    kept = []  # computed and kept whether logged or not: only the logging differs
    for _ in range(EPOCHS):
        for batch, (x,) in enumerate(sharded):
            kept.append(x.sum() + rank * 1000)
            if log:
                tpunb.log(device_value=kept[-1], host_value=float(batch))
    torch_xla.sync()
    return (
        (met.counter_value("ExecuteComputation") or 0) - executions,
        _transfers(met) - transfers,
        time.monotonic() - start,
    )


def _transfers(met):
    data = met.metric_data("TransferFromDeviceTime")
    return data[0] if data else 0


def _loader():
    return DataLoader(DATA, batch_size=4)


def test_every_logged_value_of_every_rank_reaches_the_history_exactly(cores8):
    results = tpunb.launch(_counting_steps, _loader(), True, live=False)
    history = results.history
    assert history.names() == ["device_value", "host_value"]
    for rank in range(8):
        steps, values = history.values("device_value")[rank]
        # Unshuffled, rank r reads samples r, r + 8, ... (each sample is its index).
        mine = list(range(rank, len(DATA), 8))
        sums = [rank * 1000 + sum(mine[4 * b : 4 * b + 4]) for b in range(BATCHES)]
        assert values == sums * EPOCHS
        assert history.values("host_value")[rank][1] == [b for _ in range(EPOCHS) for b in range(5)]
        assert len(steps) == EPOCHS * BATCHES == len(set(steps))
        # Progress through the loader: epoch, batch in the epoch, batches an epoch.
        batches = [(s.epoch, s.epoch_batch, s.epoch_batches) for s in history.steps[rank]]
        for epoch in range(EPOCHS):
            assert [b for e, b, _ in batches if e == epoch][-1] == BATCHES
        assert {n for _, _, n in batches if n is not None} == {BATCHES}
        # A learner's axis: training steps 1, 2, ... across epochs, epochs split after each.
        assert steps == list(range(1, EPOCHS * BATCHES + 1))
    assert history.epoch_starts() == [BATCHES * epoch for epoch in range(1, EPOCHS)]
    # The compile summary counts the same training steps, not the syncs (epoch ends too).
    assert results.compiles.steps == EPOCHS * BATCHES < len(history.steps[0])


def test_logging_device_tensors_adds_no_execution_and_no_transfer_a_step(cores8, monkeypatch):
    # One rank in its process (cores=1): torch_xla's counters are the rank's own. No flush
    # while the function runs (the forked rank takes the notebook's FLUSH_SECONDS): every
    # value comes back at its end.
    monkeypatch.setattr(recorder, "FLUSH_SECONDS", float("inf"))
    quiet = tpunb.launch(_counting_steps, _loader(), False, cores=1, live=False)
    logged = tpunb.launch(_counting_steps, _loader(), True, cores=1, live=False)
    [(quiet_executions, quiet_transfers, _)] = quiet
    [(executions, transfers, _)] = logged
    steps = EPOCHS * len(_loader())
    assert executions == quiet_executions >= steps  # the same graphs run, logging or not
    # No transfer while the steps run: the values come back at a flush, in one transfer,
    # here after the function returned; every one of them.
    assert transfers == quiet_transfers
    assert len(logged.history.values("device_value")[0][1]) == steps


def test_without_a_widget_front_end_a_line_an_epoch_then_a_last_line(cores8, capsys):
    tpunb.launch(_counting_steps, _loader(), True)  # live="auto", not in a kernel: text
    lines = capsys.readouterr().out.splitlines()
    # The mean over the cores of their last batch's value: rank r's last batch holds
    # samples r + 128, r + 136, r + 144 and r + 152.
    mean = sum(1000 * r + 4 * r + 560 for r in range(8)) / 8
    assert lines[:EPOCHS] == [
        f"epoch {e + 1}: {BATCHES} batches a core, device_value {mean:.4g}, host_value 4"
        for e in range(EPOCHS)
    ]
    [last] = lines[EPOCHS:]
    assert last.startswith(f"done: epoch {EPOCHS}, batch {BATCHES}/{BATCHES}, device_value ")
    assert "samples/s" in last and "compilations" in last


def test_a_failed_launch_says_where_it_stopped(cores8, capsys, monkeypatch):
    # Every sync sends the steps finished before it, and rank 5 raises only once the other
    # ranks have sent their epochs: their steps reach the notebook before its error does
    # (one pipe, written in order).
    monkeypatch.setattr(recorder, "FLUSH_SECONDS", 0.0)
    others_done = multiprocessing.get_context("fork").Semaphore(0)

    def fails_in_epoch_2(rank, loader):
        for epoch in range(EPOCHS):
            for (x,) in tpunb.shard(loader):
                tpunb.log(x=x.sum())
            if epoch == 1 and rank == 5:
                for _ in range(7):
                    others_done.acquire()
                raise ValueError("rank 5 broke")
        others_done.release()

    with pytest.raises(tpunb.RankError, match="rank 5 broke"):
        tpunb.launch(fails_in_epoch_2, _loader(), live="text")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("stopped: epoch ")
    assert lines[0].startswith("epoch 1: 5 batches a core")


def test_live_options_are_checked_before_any_fork(cores8):
    with pytest.raises(tpunb.TpunbError, match="'auto', 'widgets', 'text', 'off'"):
        tpunb.launch(_counting_steps, _loader(), True, live="sometimes")
    with pytest.raises(tpunb.TpunbError, match="not a notebook kernel.*live='text'"):
        tpunb.launch(_counting_steps, _loader(), True, live="widgets")
    assert live.resolve(False) == live.resolve(None) == "off"
    assert live.resolve(True) == live.resolve("auto") == "text"  # pytest is no kernel


class _Clock:
    """A clock the test moves: the views' timing without waiting."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_value_logged_long_ago_still_shows_in_the_line_and_the_last_line(capsys):
    # A learning rate logged once, then 1,100 steps of loss: the view reads the last value
    # of each name however long ago it was logged.
    history, clock = tpunb.History(2), _Clock()
    view = live.view("text", history, tpunb.watch.compile_watch.CompileWatch(2), clock)
    for rank in range(2):
        history.add(rank, [Step(0, 0.0, {"lr": 0.1, "loss": 2.0}, [], 0)])
        history.add(rank, [Step(s, s / 100, {"loss": 1.0}, [], 0) for s in range(1, 1101)])
    clock.now = 11.0
    view.update()
    view.close(failed=False)
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("done: step 1101, lr 0.1, loss 1, 0 compilations, 11 s elapsed")


def _fast_steps(history, step):
    for rank in range(history.ranks):
        history.add(rank, [Step(step, step * 0.001, {"loss": 1 / (step + 1)}, [[(8, 4)]], 8)])


def test_widgets_redraw_at_a_bounded_rate_however_fast_the_steps_come():
    history = tpunb.History(8)
    watch = tpunb.watch.compile_watch.CompileWatch(8)
    clock = _Clock()
    # Outside a kernel the widgets draw nowhere. 3,000 steps in 3 s, far faster than redraws.
    view = live.view("widgets", history, watch, clock)
    for step in range(3000):
        _fast_steps(history, step)
        clock.now = (step + 1) / 1000
        view.update()
    assert view.figures == 3 / live.FIGURE_SECONDS
    assert bytes(view.image.value[:4]) == b"\x89PNG"
    assert view.lines <= 3 / live.PROGRESS_SECONDS + 1
    shown = int(re.search(r"step (\d+)", view.line.value)[1])
    assert 0 < shown <= 3000 and "loss" in view.line.value


NOTEBOOK = [
    (
        "import time, torch, tpunb\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "tpunb.simulate(cores=8)\n"
        "tpunb.watch.live.FIGURE_SECONDS = 0  # a live frame at every turn: no clock to race\n"
        "loader = DataLoader(TensorDataset(torch.randn(8 * 160, 4)), batch_size=4)"
    ),
    (
        "def train(rank, loader):\n"
        "    for epoch in range(2):\n"
        "        for (x,) in tpunb.shard(loader):\n"
        "            time.sleep(0.01)\n"
        "            tpunb.log(loss=x.square().mean())\n"
        "    return rank"
    ),
    "print(tpunb.launch(train, loader))",
    "print(tpunb.launch(train, loader, live='widgets'))",
]


class _FrameCountingClient(NotebookClient):
    """nbclient as the kernel's front end, counting the PNG frames sent to image widgets."""

    frames = 0

    def handle_comm_msg(self, outs, msg, cell_index):
        paths = msg["content"]["data"].get("buffer_paths", [])
        self.frames += ["value"] in paths and msg["msg_type"] == "comm_msg"
        super().handle_comm_msg(outs, msg, cell_index)


@pytest.mark.pair("colab", reason="the kernel's views are torch_xla's version's alike")
def test_from_a_real_kernel_text_or_widgets_then_the_final_figure(tmp_path, monkeypatch):
    # The kernel of nbclient (and nbval) has no front end: "auto" is text there.
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("VSCODE_PID", raising=False)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK])
    client = _FrameCountingClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    text, widgets = notebook.cells[2], notebook.cells[3]

    lines = "".join(o.text for o in text.outputs if o.output_type == "stream").splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "epoch 1: 40 batches a core",
        "epoch 2: 40 batches a core",
        "done: epoch 2",
        "[0",
    ]
    # Live frames went to the image widget while the launch ran, then the widgets' output
    # was replaced by the last line.
    assert client.frames >= 1
    assert widgets.outputs[0].data["text/html"].startswith("<b>done</b>: epoch 2, batch 40/40")
    # Each run ends with its figure, drawn headless (Agg): loss, samples/s, compilations.
    for cell in (text, widgets):
        [png] = [o.data["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
        image = base64.b64decode(png)
        assert image[:4] == b"\x89PNG" and _png_size(image) == (900, round(3 * 2.6 * 90))


def _png_size(image):
    header = io.BytesIO(image[16:24]).read()
    return int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")


def test_samples_per_second_has_one_point_a_training_step_and_a_validation_slows_the_next():
    # Two epochs of 4 training steps of 8 samples, 0.1 s each; between them a validation:
    # 3 records without training samples, 0.5 s in all. The rate has one point a training
    # step after the first (the validation's records add time, not points), and the windows
    # that span the validation include its time.
    steps, time = [], 0.0
    for epoch in range(2):
        for batch in range(1, 5):
            time += 0.1
            steps.append(Step(len(steps), time, {}, [[(8, 4)]], 8, epoch=epoch, epoch_batch=batch))
        if epoch == 0:
            for _ in range(3):
                time += 0.5 / 3
                steps.append(Step(len(steps), time, {}, [], 0, epoch=0, epoch_batch=4))
    history = tpunb.History(1)
    history.add(0, steps)
    at, rates = history.samples_per_second(0, over=2)
    assert at == [2, 3, 4, 5, 6, 7, 8]
    assert rates == pytest.approx([80, 80, 80, 16 / 0.7, 16 / 0.7, 80, 80])
