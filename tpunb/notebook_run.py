"""``python -m tpunb.simulate notebook.ipynb``: a TPU notebook run top to bottom, unchanged,
in a Jupyter kernel that simulates the TPU's cores, a line a cell as it goes.

The kernel is the one Jupyter starts for this Python (``python3``), so it has this
environment's torch_xla and tpunb; it simulates the cores before the notebook's first cell,
as ``pytest --tpunb-simulate`` does for nbval's kernels. Nothing is downloaded: an install
cell (``%pip install``, ``!pip install``) gets what is already installed and fails at once
for anything else, and the run goes on. The run stops at the first cell that raises, as
the notebook would on a TPU.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

# Run in a kernel before the notebook's first cell (and by pytest's plugin in nbval's).
SIMULATE_IN_KERNEL = """\
import tpunb.simulation as __tpunb_simulation
__tpunb_simulation.simulate(cores={cores}, instead_of_tpu={instead_of_tpu})
del __tpunb_simulation
"""

# What pip prints when the package index is out of reach (here: PIP_NO_INDEX).
_PIP_WITHOUT_NETWORK = ("No matching distribution found", "Could not find a version that")

# Exit statuses: every cell (or the script) ran and the report found nothing; a cell or the
# script raised; everything ran and the report found what a TPU would meet. argparse's usage
# errors are 2.
RAN, RAISED, FOUND = 0, 3, 4


def run(path: str, cores: int, instead_of_tpu: bool = False, out=sys.stdout) -> int:
    """Runs the notebook at ``path`` on ``cores`` simulated cores; prints a line a cell and
    returns the exit status: ``RAN`` when every cell ran, ``RAISED`` when one raised."""
    try:
        import nbformat
        from jupyter_client.manager import KernelManager
        from nbclient import NotebookClient
    except ImportError:
        out.write(
            "python -m tpunb.simulate runs notebooks with nbclient: pip install nbclient "
            "ipykernel\n"
        )
        return RAISED
    notebook = nbformat.read(path, as_version=4)
    folder = os.path.dirname(os.path.abspath(path))
    # The kernel, and the pip it runs, inherit this: installs fail at once without a network.
    os.environ["PIP_NO_INDEX"] = "1"
    # The kernel listens on local sockets in a folder of its own: over TCP, ipykernel warns
    # at every start that the connection is not encrypted.
    sockets = tempfile.TemporaryDirectory(prefix="tpunb-kernel-")
    kernel = KernelManager(
        kernel_name="python3", transport="ipc", ip=os.path.join(sockets.name, "kernel")
    )
    client = NotebookClient(
        notebook, km=kernel, timeout=None, resources={"metadata": {"path": folder}}
    )
    with sockets:
        return _run_cells(client, notebook, cores, instead_of_tpu, out, path)


def _run_cells(client, notebook, cores, instead_of_tpu, out, path):
    import nbformat
    from nbclient.exceptions import CellExecutionError

    code = [i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"]
    start = time.monotonic()
    out.write(f"{os.path.basename(path)}: {len(code)} code cells on {cores} simulated cores\n")
    simulating = nbformat.v4.new_code_cell(
        SIMULATE_IN_KERNEL.format(cores=cores, instead_of_tpu=instead_of_tpu)
    )
    # cleanup_kc: the kernel is shut down at the end. nbclient leaves a kernel whose manager
    # it was given running, and it then stops only when it sees this process gone ("Parent
    # appears to have exited, shutting down", a warning on stderr after the report).
    with client.setup_kernel(cleanup_kc=True):
        # A cell of its own, first, out of the notebook's history (its cells count from 1,
        # as on a TPU); nbclient keeps what it runs in the notebook, so it goes after.
        notebook.cells.insert(0, simulating)
        try:
            client.execute_cell(simulating, 0, store_history=False)
        except CellExecutionError as failure:
            out.write(f"could not simulate {cores} cores in the kernel: {_plain(failure)}\n")
            return RAISED
        finally:
            del notebook.cells[0]
        for done, index in enumerate(code, 1):
            cell = notebook.cells[index]
            began = time.monotonic()
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as failure:
                out.write(_line(done, len(code), index, cell, began, "raised"))
                out.write(_indented(_plain(failure).strip().splitlines()[-1]) + "\n")
                out.write(f"stopped at {_name(cell, index)}: the cells after it did not run\n")
                return RAISED
            offline = _pip_without_network(cell)
            out.write(_line(done, len(code), index, cell, began, "ok"))
            if offline:
                out.write(_indented(f"pip cannot reach the network here: {offline}") + "\n")
    out.write(f"every cell ran, in {time.monotonic() - start:.0f} s\n")
    return RAN


def _line(done, total, index, cell, began, outcome):
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    first = first if len(first) <= 50 else first[:47] + "..."
    seconds = time.monotonic() - began
    progress = f"[{done:{len(str(total))}}/{total}]"
    return f"{progress} {_name(cell, index):<7} {outcome:<6} {seconds:5.1f} s  {first}\n"


def _name(cell, index):
    """The cell as IPython names it, as the report and tracebacks do: "In[4]"."""
    return f"In[{cell.get('execution_count') or index + 1}]"


def _plain(text):
    """Text without the terminal colours of IPython's tracebacks and pip's errors."""
    return re.sub(r"\x1b\[[\d;]*m", "", str(text))


def _indented(text):
    return "      " + text


def _pip_without_network(cell):
    """The line of pip's output saying what it could not install offline, if any."""
    for output in cell.get("outputs", []):
        text = _plain("".join(output.get("text", "")))
        for line in text.splitlines():
            if any(sign in line for sign in _PIP_WITHOUT_NETWORK):
                return line.removeprefix("ERROR: ").strip()
    return None
