"""``tpunb-lessons``: the lessons on this machine, no TPU needed (8 cores simulated on the CPU).

    tpunb-lessons           copy the lessons to ./tpunb-lessons and open them in JupyterLab
    tpunb-lessons --run     run the quickstart there, headless, and say where its figure is

Installed with ``pip install "tpunb[sim,lessons] @ ..."`` (the README's laptop line).
"""

import argparse
import base64
import pathlib
import shutil
import subprocess
import sys
import time

from tpunb.errors import TpunbError
from tpunb.upstream import versions

QUICKSTART = "00_quickstart.ipynb"


def shipped():
    """The lessons that came with tpunb: inside the wheel, or the repository's notebooks/
    for an editable install."""
    here = pathlib.Path(__file__).parent
    for folder in (here / "_lessons", here.parent / "notebooks"):
        if (folder / QUICKSTART).is_file():
            return folder
    raise TpunbError("The lessons did not come with this tpunb: reinstall it from its wheel.")


def copy_to(folder):
    """Copies the lessons into ``folder``, keeping any lesson already there (your edits)."""
    folder.mkdir(parents=True, exist_ok=True)
    for lesson in sorted(shipped().glob("*.ipynb")):
        if not (folder / lesson.name).exists():
            shutil.copy2(lesson, folder / lesson.name)
    return folder


def run_quickstart(folder):
    """Executes the quickstart in ``folder`` as Jupyter would; returns the notebook's path
    and the path of its last figure (a PNG beside it)."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError:
        raise TpunbError(_MISSING.format(what="nbclient")) from None
    path = folder / QUICKSTART
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    ).execute()
    nbformat.write(notebook, path)
    images = [
        output.data["image/png"]
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    figure = path.with_suffix(".png")
    figure.write_bytes(base64.b64decode(images[-1]))
    return path, figure


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="tpunb-lessons",
        description="The tpunb lessons on this machine, no TPU needed (8 cores simulated on "
        "the CPU): opens them in JupyterLab, or runs the quickstart headless.",
    )
    parser.add_argument("--run", action="store_true", help="run the quickstart headless")
    parser.add_argument("--folder", default="tpunb-lessons", help="where the lessons go")
    arguments = parser.parse_args(argv)
    folder = copy_to(pathlib.Path(arguments.folder))
    if arguments.run:
        start = time.monotonic()
        notebook, figure = run_quickstart(folder)
        print(f"Ran {notebook} in {time.monotonic() - start:.0f} s. Its figure: {figure}")
        return 0
    if shutil.which("jupyter-lab") is None:
        raise SystemExit(_MISSING.format(what="JupyterLab"))
    return subprocess.call(["jupyter-lab", str(folder / QUICKSTART)], cwd=folder.parent)


_MISSING = (
    "{what} is missing: the lessons need it. Install what they use: "
    f'pip install "{versions.requirement("sim,lessons")}"'
)

if __name__ == "__main__":
    sys.exit(main())
