"""The code keeps the style pyproject.toml declares (ruff: lint rules and formatting)."""

import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.pair("colab", reason="the same code on both pairs: checked once")

CODE = ["tpunb", "tests", "benchmarks"]


def _ruff(*args):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *CODE], cwd=ROOT, capture_output=True, text=True
    )


def test_ruff_finds_nothing_to_fix():
    result = _ruff("check", "--no-cache", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_code_is_formatted():
    result = _ruff("format", "--check", "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
