"""What the compile watch says about each cause it finds: what happened, where, and the
fix. The watch (``compile_watch.py``) decides when a cause is one; this module has the
words."""

from tpunb.wording import reports

# Why an op runs on the CPU, for the ops training code triggers most.
_FALLBACK_CAUSES = {
    "aten::_local_scalar_dense": (
        ".item(), float(t), int(t) or a Python if on a tensor: the step stops, its graph "
        "runs and the value is copied to the host. Log device tensors with tpunb.log(...) "
        "(read back in batches), or keep the test on the device with torch.where"
    ),
    "aten::nonzero": (
        "a boolean mask (x[mask]) or torch.nonzero: the result's shape depends on the data. "
        "Multiply by the mask, or use torch.where, to keep shapes fixed"
    ),
    "aten::masked_select": (
        "masked_select: the result's shape depends on the data. Multiply by the mask "
        "instead, to keep shapes fixed"
    ),
}

# Where a framework runs the loop: what it reads back itself.
_LIGHTNING_READS = (
    ". In PyTorch Lightning, self.log(..., prog_bar=True) makes one at every batch: "
    "Lightning reads the value back for its progress bar. Leave prog_bar out: the live "
    "view shows the value"
)


def fallback(where, op, framework):
    """``op`` ran on the CPU at ``where`` ("epoch 1, batch 3"); ``framework``: a framework
    runs the loop."""
    why = _FALLBACK_CAUSES.get(op, "an op torch_xla has no XLA lowering for")
    if framework and op == "aten::_local_scalar_dense":
        why += _LIGHTNING_READS
    return (
        f"{where} ran {op} on the CPU (a fallback: the step's graph is cut there and data "
        f"goes through the host). Likely cause: {why}."
    )


def read(where, kind, what, file, line, waiting_steps):
    """A read of a device value at ``file``, ``line``: ``kind`` "cut" (the step had not
    computed it yet) or "wait" (in ``waiting_steps`` steps, an execution was still
    computing it)."""
    if kind == "cut":
        why = (
            "read a value the step had not computed yet. torch_xla ran the step's graph up "
            "to that value there, and at the sync runs the step's graph as another, the work "
            "before the read included: two graphs a step, and work done twice."
        )
    else:
        why = (
            f"has waited for the device in {waiting_steps} steps: it read a value the step's "
            "execution was still computing. It cuts no graph, but each time the host stops "
            "there until the device is done, instead of tracing the next step meanwhile."
        )
    hint = _LIGHTNING_READS if "lightning" in file else ""
    return (
        f"{where}: {what} at {file}, line {line} {why} Read values after torch_xla.sync() "
        "only where needed, in xm.add_step_closure(...), or log them with tpunb.log(...), "
        f"read back in batches{hint}."
    )


def split(where, what, file, line):
    """A sync of the program's at ``file``, ``line`` ended a step that another sync, in the
    same batch of the loader, ended again: the step ran as two graphs."""
    return (
        f"{where}: {what} at {file}, line {line} ran the step's work before its batch was "
        "done, and another sync in the same batch ran the work traced after it: two graphs "
        "a step instead of one, each dispatched and waited for. torch_xla's loader "
        "(MpDeviceLoader, tpunb.shard) already syncs at every batch: remove this call, or "
        "move the work traced after it before it."
    )


# Distinct batch shapes a run may have without a warning: each compiles once, and a few
# is what padding to buckets gives (the messages below advise 4).
FEW_SHAPES = 4


def compiled(where, compiles, new, usual, shapes_so_far):
    """(key, message) for ``compiles`` new graphs at ``where``: ``new``, the batch shapes
    first seen there (none: the graph itself changed); ``usual``, the most common batch
    size; ``shapes_so_far``, the distinct shapes seen by then."""
    graphs = reports.count(compiles, "new graph")
    if not new:
        return "graph", (
            f"{where} compiled {graphs} with batch shapes seen before: the graph "
            "itself changed, e.g. a Python branch on a tensor value, a value that is a "
            "Python number one step and another the next, or a different code path "
            "(evaluation, logging). Keep the step's code path the same every step."
        )
    short = [key for key in new if key[0] and key[0][0] < usual]
    if short and len(short) == len(new):
        return "short batch", (
            f"{where} compiled {graphs}: batch shape {_format(short[0])} is smaller "
            f"than the usual batch of {usual}, the short last batch of an epoch. Build the "
            "DataLoader with drop_last=True, or pad it to the full batch with "
            f"tpunb.BucketCollate(..., batch_size={usual})."
        )
    return "shapes", (
        f"{where} compiled {graphs}: batch shape {_format(new[0])} not seen before; "
        f"{reports.count(shapes_so_far, 'distinct shape')} so far. Every new "
        "shape is a new graph to compile. Pad to buckets: DataLoader(..., collate_fn="
        f"tpunb.BucketCollate(tpunb.choose_buckets(lengths, {FEW_SHAPES}, batch_size=...))) "
        f"gives at most {FEW_SHAPES} shapes."
    )


def _format(key):
    return " and ".join(str(shape) for shape in key)
