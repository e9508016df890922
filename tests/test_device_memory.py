"""Each core's device memory in a launch: measured where the device reports it (a TPU),
said to be unmeasured where it does not (XLA's CPU client), a warning near the limit, and
an out-of-memory error explained with the core's last use."""

import re
import warnings

import pytest
import torch

import tpunb
from tpunb.launcher import failures
from tpunb.launcher.channel import Raised
from tpunb.watch import device_memory
from tpunb.watch.history import History, Step
from tpunb.watch.live import Snapshot

GiB = 2**30


def _step(number, used=None, limit=16 * GiB):
    memory = None if used is None else (int(used * GiB), int(used * GiB), limit)
    return Step(number, float(number), {}, [], 0, memory=memory)


def test_a_core_near_its_limit_is_warned_about_once_and_shown_in_the_progress_line():
    history, watch = History(2), device_memory.NearLimit()
    for rank in range(2):
        steps = [_step(0, 4.0), _step(1), _step(2, 12.0 + rank)]
        history.add(rank, steps)
        assert watch.add(rank, steps) == []
    late = [_step(3, 14.6)]
    history.add(1, late)
    [message] = watch.add(1, late)
    assert message.startswith("Core 1 uses 14.6 of 16.0 GiB (91%), peak 14.6 GiB of its device")
    assert "at step 4" in message and "RESOURCE_EXHAUSTED" in message
    assert watch.add(0, [_step(4, 15.0)]) == []  # once a launch
    assert history.device_memory()[1].used == int(14.6 * GiB)
    parts = Snapshot.of(history, compiles=0, elapsed=1.0).parts()
    assert "device memory 14.6/16.0 GiB" in parts


def test_without_a_measurement_nothing_is_shown():
    history = History(1)
    history.add(0, [_step(0), _step(1)])
    assert history.device_memory() == {}
    assert not any("memory" in part for part in Snapshot.of(history, 0, 1.0).parts())


def test_an_out_of_memory_error_is_explained_with_the_cores_last_use():
    raised = Raised(2, "raised RuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating", "tb")
    last = device_memory.Use(int(15.5 * GiB), int(15.9 * GiB), 16 * GiB)
    message = str(failures.raised_error({2: raised}, {2: last}))
    assert "Likely cause: Core 2 ran out of device memory (HBM). Its last measured use: " in message
    assert "15.5 of 16.0 GiB (97%), peak 15.9 GiB" in message
    assert "smaller batch a core, bf16" in message
    unmeasured = str(failures.raised_error({2: raised}, {}))
    assert "Its use was not measured" in unmeasured


def _measured(rank):
    return device_memory.Reader().read(), device_memory.Reader().read()


def test_simulated_cores_say_their_memory_is_not_measured(cores8):
    # XLA's CPU client does not report device memory (GetAllocatorStats is UNIMPLEMENTED):
    # each rank reads None, quietly, and its steps carry no measurement.
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpunb.TpunbWarning)
        results = tpunb.launch(_measured, live=False)
    assert list(results) == [(None, None)] * 8
    assert results.history.device_memory() == {}


@pytest.mark.parametrize("fullness", [0.5, 0.89])
def test_below_the_limit_nothing_is_said(fullness):
    assert device_memory.NearLimit().add(0, [_step(0, 16 * fullness)]) == []


def _attends_to_a_million_positions(rank):
    import torch_xla

    keys = torch.ones(2**20, 16, device=torch_xla.device())
    scores = keys @ keys.T  # 2**20 x 2**20 numbers: 4 TiB, which no device has
    return scores.sum().item()


def test_a_rank_out_of_device_memory_is_named_with_the_programs_line(cores8):
    with pytest.raises(tpunb.RankError) as caught:
        tpunb.launch(_attends_to_a_million_positions, live=False)
    message = str(caught.value)
    assert "Out of memory allocating" in message  # 2.8 puts "RESOURCE_EXHAUSTED: " before
    assert "ran out of device memory (HBM). Its use was not measured (simulated cores" in message
    # The traceback ends at the program's read, not in tpunb's wrapper around it.
    frames = re.findall(r'File "(.+)", line \d+, in (\w+)', caught.value.remote_traceback)
    assert frames[-1] == (__file__, "_attends_to_a_million_positions")


def test_out_of_memory_is_recognized_as_each_torch_xla_and_device_words_it():
    said = [
        "RESOURCE_EXHAUSTED: Out of memory allocating 4398046511104 bytes.",  # 2.8, the CPU
        "Out of memory allocating 4398046511104 bytes.",  # 2.9 drops the status code
        "XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.5G",
        "Error allocating device buffer: Attempting to allocate 20.5G. That was not possible.",
    ]
    assert all(device_memory.is_out_of_memory(text) for text in said)
    assert not device_memory.is_out_of_memory("INVALID_ARGUMENT: shapes f32[4] and f32[5]")


def test_a_device_that_reports_no_limit_shows_its_use_and_never_divides_by_it():
    # A limit of 0 (a device that reports none) raised ZeroDivisionError in the progress
    # line and in an out-of-memory error's words.
    history = History(2)
    history.add(0, [_step(0, 2.0, limit=0)])
    history.add(1, [_step(0, 3.0, limit=0)])
    parts = Snapshot.of(history, compiles=0, elapsed=1.0).parts()
    assert "device memory 3.0 GiB" in parts  # the core that uses most, with no limit to show
    last = device_memory.Use(3 * GiB, 4 * GiB, 0)
    assert device_memory.in_words(last) == "3.0 GiB, peak 4.0 GiB (no limit reported)"
