import importlib.metadata
import os
import subprocess
import sys
import textwrap
from html import escape

import pytest
from conftest import run_python

import tpunb
from tpunb import environment, hardware, machine, tpu_holders
from tpunb.environment import Environment
from tpunb.machine import Layout


def _fake_pci(root, *device_ids):
    for i, device_id in enumerate(device_ids):
        slot = root / f"0000:00:{i:02x}.0"
        slot.mkdir(parents=True)
        (slot / "vendor").write_text("0x1ae0\n")
        (slot / "device").write_text(f"{device_id}\n")
    other = root / "0000:01:00.0"
    other.mkdir()
    (other / "vendor").write_text("0x8086\n")
    (other / "device").write_text("0x0027\n")
    return root


@pytest.mark.parametrize(
    "device_id, chips, accelerator_type_env, name, cores, layout",
    [
        ("0x0027", 4, "v3-8", "v3-8", 8, (4, 2)),
        ("0x0027", 4, "v2-8", "v2-8", 8, (4, 2)),
        ("0x0027", 4, None, "v2/v3-8", 8, (4, 2)),
        ("0x005e", 4, None, "v4-8", 4, (4, 1)),
        ("0x0063", 8, None, "v5e-8", 8, (8, 1)),
        ("0x0063", 1, None, "v5e-1", 1, (1, 1)),
        ("0x006f", 1, None, "v6e-1", 1, (1, 1)),
    ],
)
def test_tpu_generation_cores_and_launch_layout_come_from_pci(
    tmp_path, monkeypatch, device_id, chips, accelerator_type_env, name, cores, layout
):
    monkeypatch.delenv("ACCELERATOR_TYPE", raising=False)
    if accelerator_type_env:
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accelerator_type_env)
    else:
        monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    tpu = hardware.detect(_fake_pci(tmp_path, *[device_id] * chips))
    found = Layout(cores=tpu.cores, processes=tpu.chips, tpu=tpu)
    report = Environment("colab", found, tpu, "3.11", "2.9.0", "2.9.0", False, (), ())
    assert (tpu.accelerator_type, report.cores) == (name, cores)
    assert (report.processes, report.threads_per_process) == layout


def test_a_tpu_with_two_cores_a_process_is_described_and_its_launch_refused(tmp_path):
    # TPU v2 and v3 run two cores a process (threads): no platform offers one now, and
    # tpunb launches a process a core. Refused before anything starts, with what to do.
    root = _fake_pci(tmp_path, *["0x0027"] * 4)
    result = run_python(
        f"""
        import functools, os
        os.environ["TPU_ACCELERATOR_TYPE"] = "v3-8"
        import tpunb
        from tpunb import hardware
        hardware.detect = functools.partial(hardware.detect, {str(root)!r})
        report = tpunb.env()
        print(report.cores, report.processes, report.threads_per_process)
        print([w for w in report.warnings if "2 cores a process" in w])
        try:
            tpunb.launch(lambda rank: rank)
        except tpunb.TpunbError as error:
            print(error)
        """
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "8 4 2", result.stderr[-3000:]
    assert "tpunb.launch runs only where each core has its process" in lines[1]
    assert lines[2].startswith(
        "This v3-8 runs 4 processes x 2 threads: two cores share each process, and tpunb "
        "launches one core a process"
    ), result.stdout + result.stderr[-3000:]
    assert "tpunb.launch(fn, cores=1)" in lines[2]


def test_no_google_device_means_no_tpu(tmp_path):
    assert hardware.detect(_fake_pci(tmp_path)) is None


@pytest.mark.parametrize(
    "variable, expected",
    [
        ("COLAB_RELEASE_TAG", "colab"),
        ("KAGGLE_KERNEL_RUN_TYPE", "kaggle"),
        ("BINDER_LAUNCH_HOST", "binder"),
    ],
)
def test_platform_is_read_from_the_environment(monkeypatch, variable, expected):
    for other in (
        "COLAB_RELEASE_TAG",
        "KAGGLE_KERNEL_RUN_TYPE",
        "KAGGLE_URL_BASE",
        "BINDER_LAUNCH_HOST",
        "BINDER_REPO_URL",
    ):
        monkeypatch.delenv(other, raising=False)
    assert machine.platform() == "script"
    monkeypatch.setenv(variable, "1")
    assert machine.platform() == expected


def test_report_says_what_torch_tpu_is_where_it_is_installed(tmp_path):
    # An installed distribution, as pip leaves its metadata (TorchTPU itself needs torch
    # 2.11 and a TPU: it cannot be installed beside torch_xla 2.8/2.9).
    info = tmp_path / "torch_tpu-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_tpu\nVersion: 0.2.0\n")
    code = "import tpunb; print([w for w in tpunb.env().warnings if 'TorchTPU' in w])"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "torch_tpu 0.2.0 (TorchTPU, Google's replacement" in result.stdout, result.stderr
    assert "cannot launch or simulate TorchTPU" in result.stdout
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_report_without_simulation_says_how_to_simulate():
    result = run_python(
        """
        import tpunb
        report = tpunb.env()
        print(report.tpu, report.cores, report.torch, report.torch_xla, report.platform)
        print(any("tpunb.simulate(cores=8)" in w for w in report.warnings))
        """
    )
    versions = f"{importlib.metadata.version('torch')} {importlib.metadata.version('torch_xla')}"
    assert result.stdout.split("\n")[:2] == [f"None 0 {versions} script", "True"], result.stderr


def test_report_of_simulated_cores_as_text_and_html():
    tpunb.simulate(cores=8)
    report = tpunb.env()
    assert (report.cores, report.processes, report.threads_per_process) == (8, 8, 1)
    assert not report.runtime_started
    assert report.warnings == ()
    described = "8 processes x 1 thread: a process a core, as on a TPU v5e"
    text = str(report)
    assert "8 TPU cores simulated on the CPU" in text and described in text
    html = report._repr_html_()
    assert "<table>" in html and escape(described) in html


def test_kaggle_presets_are_flagged_where_a_tpu_would_read_them(tmp_path, monkeypatch, cores8):
    monkeypatch.setenv("TPU_PROCESS_ADDRESSES", "local")
    tpu = hardware.detect(_fake_pci(tmp_path, *["0x0063"] * 8))  # Kaggle's v5e-8
    report = Environment(
        "kaggle",
        Layout(cores=8, processes=8, tpu=tpu),
        tpu,
        "3.12",
        "2.8.0",
        "2.8.0",
        False,
        (),
        (),
    )
    assert any("TPU_PROCESS_ADDRESSES='local'" in w for w in environment._warnings(report))
    # simulate() presets them as Kaggle's image does (its notebooks pop them); the
    # simulated cores never read them.
    assert os.environ["CLOUD_TPU_TASK_ID"] == "0"
    assert not any("TPU_PROCESS_ADDRESSES" in w for w in tpunb.env().warnings)


def test_report_never_starts_the_runtime_and_sees_when_it_was_started():
    result = run_python(
        """
        import tpunb, torch_xla
        tpunb.simulate(cores=8)
        first = tpunb.env().runtime_started
        assert not torch_xla._XLAC._xla_runtime_is_initialized()
        torch_xla.device()
        report = tpunb.env()
        restart = any("restart the kernel" in w for w in report.warnings)
        print(first, report.runtime_started, restart)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False True True")


def test_processes_holding_the_tpu_are_named_with_how_to_free_them(tmp_path):
    # A process that holds a stand-in device file open and libtpu's lock, as a rank left
    # running by an interrupted xmp.spawn holds the TPU (pytorch/xla #7974).
    device, lock = tmp_path / "accel0", tmp_path / "libtpu_lockfile"
    device.write_bytes(b"")
    holds = f"""
        import fcntl, sys
        device = open({str(device)!r})
        lock = open({str(lock)!r}, "w")
        fcntl.lockf(lock, fcntl.LOCK_EX)  # as libtpu takes it
        print("holding", flush=True)
        sys.stdin.read()
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(holds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    pci = _fake_pci(tmp_path / "pci", *["0x0063"] * 8)  # Kaggle's v5e-8
    report_on_a_v5e_8 = f"""
        import functools
        import tpunb
        from tpunb import hardware, tpu_holders
        hardware.detect = functools.partial(hardware.detect, {str(pci)!r})
        tpu_holders.find = functools.partial(tpu_holders.find, ({str(device)!r},), {str(lock)!r})
        report = tpunb.env()
        print([(holder.pid, holder.holds) for holder in report.holders])
        print(str(report))
    """
    try:
        assert holder.stdout.readline() == b"holding\n"
        held = tpu_holders.find((str(device),), str(lock))
        assert [(h.pid, h.holds) for h in held] == [(holder.pid, (str(device), str(lock)))]
        assert "-c" in held[0].command
        printed = run_python(report_on_a_v5e_8).stdout
        assert f"[({holder.pid}, ({str(device)!r}, {str(lock)!r}))]" in printed
        assert f"!kill -9 {holder.pid}" in printed and "TPU is held by another process" in printed
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert tpu_holders.find((str(device),), str(lock)) == []
    printed = run_python(report_on_a_v5e_8).stdout
    assert "no other process: the TPU is free" in printed and "held by another" not in printed
