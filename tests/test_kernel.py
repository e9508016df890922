"""launch from a real Jupyter kernel: forking from a kernel is the main use."""

import nbformat
from nbclient import NotebookClient

CELLS = [
    "import tpunb\ntpunb.simulate(cores=8);",
    # A function defined in the notebook, and a closure over notebook state.
    (
        "def train(rank, scale):\n"
        "    import torch_xla.runtime as xr\n"
        "    return rank * scale, xr.world_size()\n"
        "print(tpunb.launch(train, 10))"
    ),
    "offset = 5\nprint(tpunb.launch(lambda rank: rank + offset))",
    (
        "def broken(rank):\n"
        "    if rank == 3:\n"
        "        raise ValueError('rank 3 is broken')\n"
        "    return rank\n"
        "tpunb.launch(broken)"
    ),
    "print(tpunb.launch(lambda rank: rank * rank))",
    "tpunb.launch(train, 1, start_method='spawn')",
    (
        "import torch\n"
        "loader = torch.utils.data.DataLoader(range(8), num_workers=2)\n"
        "tpunb.launch(lambda rank, loader: rank, loader);"
    ),
]


def _output_text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_launch_from_a_jupyter_kernel(tmp_path):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    cells = notebook.cells
    assert (
        "[(0, 8), (10, 8), (20, 8), (30, 8), (40, 8), (50, 8), (60, 8), (70, 8)]"
        in _output_text(cells[1])
    )
    assert "[5, 6, 7, 8, 9, 10, 11, 12]" in _output_text(cells[2])
    (error,) = [o for o in cells[3].outputs if o.output_type == "error"]
    assert error.ename == "RankError"
    assert error.evalue.startswith("rank 3 raised ValueError: rank 3 is broken")
    assert "raise ValueError('rank 3 is broken')" in error.evalue
    # The rank's traceback names the cell as IPython's own tracebacks do.
    assert 'File "cell In[4]", line 3, in broken' in error.evalue
    assert "ipykernel" not in error.evalue
    # The kernel survives the failure and launches again.
    assert "[0, 1, 4, 9, 16, 25, 36, 49]" in _output_text(cells[4])
    (refusal,) = [o for o in cells[5].outputs if o.output_type == "error"]
    assert refusal.ename == "TpunbError"
    assert "spawned processes cannot find the functions defined in it" in refusal.evalue
    # A warning names the cell and line, as a traceback does, not IPython's temporary file.
    warned = _output_text(cells[6])
    assert "cell In[7]:3: TpunbWarning: A DataLoader with num_workers=2" in warned
    assert "ipykernel" not in warned
