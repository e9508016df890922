"""tpunb-lessons: a learner's one command, run as they would run it."""

import pathlib
import subprocess
import sys

import pytest


@pytest.mark.pair("colab", reason="tpunb[sim,lessons] installs Colab's pair")
def test_the_quickstart_runs_headless_and_says_where_its_figure_is(tmp_path):
    folder = tmp_path / "lessons"
    ran = subprocess.run(
        [sys.executable, "-m", "tpunb.lessons", "--run", "--folder", str(folder)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    figure = folder / "00_quickstart.png"
    assert ran.stdout.strip().endswith(f"Its figure: {figure}")
    assert figure.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in folder.glob("0*.ipynb"))[0] == "00_quickstart.ipynb"
    assert len(list(folder.glob("*.ipynb"))) >= 6  # every lesson, ready to open


def test_the_lessons_command_is_installed_and_explains_itself():
    command = pathlib.Path(sys.executable).parent / "tpunb-lessons"  # beside this Python
    helped = subprocess.run([command, "--help"], capture_output=True, text=True)
    assert "--run" in helped.stdout and "tpunb-lessons" in helped.stdout
