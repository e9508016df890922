"""Where in the user's program something happened: the innermost frame outside torch,
torch_xla and tpunb, named as a learner reads it (a notebook cell as "cell In[3]")."""

import functools
import os
import sys
import traceback


@functools.cache
def libraries(own=True):
    """The folders of torch's and torch_xla's code (and tpunb's, if ``own``): frames there
    are not the program's."""
    import torch
    import torch_xla

    modules = (torch, torch_xla, sys.modules["tpunb"]) if own else (torch, torch_xla)
    return tuple(os.path.dirname(module.__file__) + os.sep for module in modules)


def program_frame(frame, libraries):
    """(the program's innermost frame, or None; the outermost torch_xla function between
    it and ``frame``, e.g. "save", or None): frames of ``libraries`` and of threading are
    skipped."""
    torch_xla = libraries[1]
    entry = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(libraries) or filename.endswith("/threading.py")):
            return frame, entry
        if filename.startswith(torch_xla):
            entry = frame.f_code.co_name
        frame = frame.f_back
    return None, entry


def cell_or_file(filename):
    """A notebook cell's code as IPython names it in tracebacks ("cell In[3]"), not its
    temporary file; a script's file as given."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    name = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(filename)
    return f"cell {name[1]}" if name else filename


def formatted_traceback(error, frames):
    """``traceback.format_exception``'s lines for ``error`` from ``frames`` on, with each
    notebook cell named as IPython's own tracebacks name it ("cell In[4]"), not by the
    temporary file the cell was compiled into."""
    summary = traceback.TracebackException(type(error), error, frames)
    # tpunb's wrappers that pass a call on (to the loader, a sync, a read) hide themselves,
    # as pytest's do: a local ``__tracebackhide__``. The program's line and torch's remain.
    walked = traceback.walk_tb(frames)
    hidden = [frame.f_locals.get("__tracebackhide__") for frame, _ in walked]
    if len(hidden) == len(summary.stack):
        shown = zip(summary.stack, hidden, strict=True)
        summary.stack[:] = [frame for frame, hide in shown if not hide]
    _name_cells(summary, set())
    return list(summary.format())


def _name_cells(summary, seen):
    if summary is None or id(summary) in seen:
        return
    seen.add(id(summary))
    for frame in summary.stack:  # each frame's source line is read already
        frame.filename = cell_or_file(frame.filename)
    _name_cells(summary.__cause__, seen)
    _name_cells(summary.__context__, seen)
