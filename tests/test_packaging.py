"""tpunb as it would be published: one place says where it installs from, the README and
every notebook say the same, and the built sdist and wheel install alone in a clean venv."""

import json
import re
import subprocess
import sys
import venv
import zipfile

import pytest
from conftest import ROOT

import tpunb
from tpunb.upstream import versions

pytestmark = pytest.mark.pair("colab", reason="the same package on both pairs: built once")

SOURCE = re.compile(r"git\+https://[^\s\"'`\\]+")


def _first_code_cell(path):
    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def test_the_readme_and_every_notebook_install_from_the_one_constant():
    assert versions.INSTALL_FROM.endswith(f"@v{tpunb.__version__}")
    readme = (ROOT / "README.md").read_text()
    assert set(SOURCE.findall(readme)) == {versions.INSTALL_FROM}
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 6
    for notebook in notebooks:
        cell = _first_code_cell(notebook)
        assert f'%pip install --quiet "{versions.requirement()}"' in cell, notebook.name
        # A learner without a TPU is told what the lessons need.
        assert f'%pip install "{versions.requirement("sim,notebooks")}"' in cell, notebook.name
        assert set(SOURCE.findall(notebook.read_text())) == {versions.INSTALL_FROM}


def test_the_readme_stays_a_newcomers_page():
    # What tpunb is, install, first run, the lessons, where it runs: developer and CI
    # material lives in docs/. It had grown past this, one table at a time.
    assert len((ROOT / "README.md").read_text()) <= 14_000


def test_the_sdist_and_the_wheel_pass_twine_and_install_alone(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
    )
    names = sorted(path.name for path in dist.iterdir())
    version = tpunb.__version__
    assert names == [f"tpunb-{version}-py3-none-any.whl", f"tpunb-{version}.tar.gz"]
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0 and checked.stdout.count("PASSED") == 2, checked.stdout
    wheel = dist / names[0]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"tpunb-{version}.dist-info/METADATA").decode()
        scripts = archive.read(f"tpunb-{version}.dist-info/entry_points.txt").decode()
        lessons = sorted(n for n in archive.namelist() if n.startswith("tpunb/_lessons/"))
    # The lessons travel with the wheel, for tpunb-lessons.
    shipped = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [n for n in lessons if n.endswith(".ipynb")] == [f"tpunb/_lessons/{n}" for n in shipped]
    assert "tpunb-lessons = tpunb.lessons:main" in scripts
    # torch and torch_xla come only with an extra: Colab's and Kaggle's stay as they are.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in line for line in requires)
    clean = tmp_path / "clean"
    venv.create(clean, with_pip=True)
    python = clean / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", wheel], check=True
    )
    imported = subprocess.run(
        [python, "-c", "import sys, tpunb; print(tpunb.__version__, 'torch' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert imported.stdout.split() == [version, "False"], imported.stderr
