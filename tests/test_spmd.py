"""SPMD on simulated cores as on a v5e-8: one process drives every chip. A program that
turns SPMD on sees the 8 devices, of the TPU's type, and trains on a mesh over them the
weights one device trains."""

import os
import subprocess
import sys

import torch
from conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "third_party", "spmd_training.py")


def _train(path, *flags):
    command = [sys.executable, "-m", "tpunb.simulate", "--cores", "8", SCRIPT, path, *flags]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, torch.load(path)


def test_spmd_trains_on_a_mesh_of_the_8_devices_what_one_device_trains(tmp_path):
    said, sharded = _train(str(tmp_path / "spmd.pt"))
    assert "devices 8 TPU" in said
    # The hidden layer split in 2 along 'model', replicated over the 4 of 'data'.
    assert (
        "linear[0].weight sharding {devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}" in said
    )
    _, one = _train(str(tmp_path / "one.pt"), "--one-device")
    assert sharded["initial"].keys() == one["trained"].keys()
    for name, weight in one["trained"].items():
        assert not torch.equal(weight, one["initial"][name]), name  # trained
        assert torch.equal(sharded["initial"][name], one["initial"][name]), name
        # A sharded matmul sums its parts in another order: the last bits may differ.
        torch.testing.assert_close(sharded["trained"][name], weight, rtol=1e-5, atol=1e-7)
