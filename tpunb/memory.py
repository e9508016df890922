"""Memory, device and host: what a model replica holds on each core (weights, gradients,
optimizer state, activations) against each TPU's memory (HBM) per core, and what the
processes of a launch hold in the host's memory (RSS, PSS, private). Measured on the CPU,
before any launch: nothing here starts the XLA runtime."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import TYPE_CHECKING

from tpunb import reports
from tpunb.errors import TpunbError

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import torch

GiB = 2**30
MB = 10**6
# HBM a core (an XLA device) of each TPU generation: a chip's HBM divided by the devices
# it exposes (v2 and v3 chips have two TensorCores, each its own device; later chips one).
# Cloud TPU's system architecture pages: https://cloud.google.com/tpu/docs/system-architecture-tpu-vm
HBM_PER_CORE = {
    "v2": 8 * GiB,
    "v3": 16 * GiB,
    "v4": 32 * GiB,
    "v5e": 16 * GiB,
    "v5p": 95 * GiB,
    "v6e": 32 * GiB,
}


@dataclasses.dataclass(frozen=True, repr=False)
class ReplicaMemory(reports.Report):
    """The memory one core's replica of a model needs during a training step, in bytes.
    ``activations`` are the tensors autograd keeps for the backward pass, measured for one
    per-core batch; XLA may fuse or recompute some, so a TPU may need somewhat less."""

    weights: int
    gradients: int
    optimizer_state: int
    activations: int | None  # None when no batch was given
    description: str = ""
    cast_weights: int = 0  # copies of the weights in a lower precision, made by autocast

    @property
    def total(self):
        return sum(self.parts().values())

    def parts(self):
        """{part: bytes}, in the order they arise in a step."""
        parts = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer state": self.optimizer_state,
        }
        if self.activations is not None:
            parts["activations"] = self.activations
        if self.cast_weights:
            parts["weights cast by autocast"] = self.cast_weights
        return parts

    def fits(self, generation):
        """The share of a core's HBM on TPU ``generation`` ("v5e") this replica takes."""
        if generation not in HBM_PER_CORE:
            raise TpunbError(
                f"Unknown TPU generation {generation!r}: one of {', '.join(HBM_PER_CORE)}."
            )
        return self.total / HBM_PER_CORE[generation]

    def _content(self):
        rows = [(part, _size(size)) for part, size in self.parts().items()]
        rows.append(("total a core", _size(self.total)))
        rows += [
            (f"share of a {generation} core's HBM", f"{self.fits(generation):.2%}")
            for generation in ("v5e", "v6e")
        ]
        title = "Memory of one core's model replica" + (
            f" ({self.description})" if self.description else ""
        )
        return title, rows, []


def replica_memory(
    model: torch.nn.Module,
    batch: Any = None,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    autocast: torch.dtype | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
) -> ReplicaMemory:
    """What one core holds to train ``model``: its weights, their gradients, the state of
    ``optimizer`` (a class or a function of the parameters, e.g. ``torch.optim.Adam``) and
    the activations of one per-core ``batch`` (the model's input, or ``(input, target)``
    with ``loss(output, target)``), measured by running one step on a CPU copy of the
    model. ``autocast``: a dtype such as ``torch.bfloat16``, to measure the step run under
    ``torch.autocast``. The model itself is not changed.

    No backward pass runs: the tensors it would use are counted as the forward pass saves
    them, and the optimizer steps on zero gradients. A backward pass in the notebook would
    start autograd's device threads there before torch_xla's devices exist, and the
    launches after it would fail (https://github.com/pytorch/xla/issues/4174).

    Args:
        model: the model each core trains (left unchanged).
        batch: one core's batch, or None for weights, gradients and optimizer only.
        optimizer: an optimizer class or a function of the parameters; None: no state.
        autocast: a dtype to run the step under ``torch.autocast``, or None.
        loss: ``loss(output, target)`` when ``batch`` is ``(input, target)``.

    Returns:
        A ``ReplicaMemory``: bytes by kind (shown as a table in a notebook)."""
    import torch

    # On one thread: a multi-threaded CPU matmul here would start OpenMP's thread team in
    # the notebook, and a process forked after it (each launch's) hangs in its first
    # OpenMP region (GNU libgomp is not fork-safe: https://github.com/pytorch/pytorch/issues/17199).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replica_memory(model, batch, optimizer, autocast, loss)
    finally:
        torch.set_num_threads(threads)


def _replica_memory(model, batch, optimizer, autocast, loss):
    import torch

    replica = copy.deepcopy(model).cpu()
    parameters = [p for p in replica.parameters() if p.requires_grad]
    weights = sum(_bytes(p) for p in replica.parameters())
    gradients = sum(_bytes(p) for p in parameters)
    activations, cast_weights = None, 0
    if batch is not None:
        inputs, target = batch if isinstance(batch, (tuple, list)) else (batch, None)
        activations, cast_weights = _saved_for_backward(replica, inputs, target, loss, autocast)
    for p in parameters:  # an optimizer's step needs gradients: zeros stand for them
        p.grad = torch.zeros_like(p)
    state = 0
    if optimizer is not None:
        chosen = optimizer(parameters)
        chosen.step()  # optimizers create their state at the first step
        state = sum(
            _bytes(value)
            for per_parameter in chosen.state.values()
            for value in per_parameter.values()
            if torch.is_tensor(value)
        )
    names = [type(model).__name__]
    if optimizer is not None:
        names.append(getattr(optimizer, "__name__", "optimizer"))
    if batch is not None:
        names.append(f"batch of {len(inputs)}")
    if autocast is not None:
        names.append(f"autocast to {str(autocast).removeprefix('torch.')}")
    return ReplicaMemory(weights, gradients, state, activations, ", ".join(names), cast_weights)


def replica_memory_of(
    parameters: int, optimizer_states: int = 2, bytes_per_number: int = 4, name: str = ""
) -> ReplicaMemory:
    """The same for a model known by its parameter count, without activations: weights
    and gradients of ``bytes_per_number`` each, and ``optimizer_states`` numbers a
    parameter (Adam and AdamW keep 2, SGD with momentum 1, plain SGD 0).

    Args:
        parameters: the model's parameter count.
        optimizer_states: numbers the optimizer keeps a parameter.
        bytes_per_number: 4 for float32, 2 for bfloat16.
        name: what the report calls the model.

    Returns:
        A ``ReplicaMemory`` without activations."""
    size = parameters * bytes_per_number
    return ReplicaMemory(size, size, optimizer_states * size, None, name)


def _saved_for_backward(model, inputs, target, loss, autocast):
    """Bytes of the tensors autograd keeps for the backward pass of one step, counted as
    the forward pass saves them: (activations, weights cast to a lower precision by
    autocast). The model's own parameters are not counted: they are the weights."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations, casts = {}, {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            kept = casts if _cast_of_a_parameter(tensor) else activations
            kept[pointer] = max(kept.get(pointer, 0), tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            output = model(inputs)
            if target is not None:
                if loss is None:
                    raise TpunbError(
                        "replica_memory got (input, target) as its batch: pass the loss "
                        "too, e.g. loss=torch.nn.functional.cross_entropy."
                    )
                loss(output, target)
            else:
                output.float().sum()
    return sum(activations.values()), sum(casts.values())


_VIEWS = {
    "TBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ViewBackward0",
    "ExpandBackward0",
}


def _cast_of_a_parameter(tensor):
    """Is ``tensor`` (a view of) a parameter converted to another dtype, as autocast makes
    them for a matmul?"""
    grad_fn = tensor.grad_fn
    while grad_fn is not None and grad_fn.name() in _VIEWS:
        grad_fn = grad_fn.next_functions[0][0]
    if grad_fn is None or grad_fn.name() != "ToCopyBackward0":
        return False
    source = grad_fn.next_functions[0][0]
    return source is not None and hasattr(source, "variable")  # AccumulateGrad: a leaf


def _bytes(tensor):
    return tensor.numel() * tensor.element_size()


def _size(size):
    if size >= GiB:
        return f"{size / GiB:.1f} GiB"
    return f"{size / MB:.2f} MB" if size < 10 * MB else f"{size / MB:.0f} MB"


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """One process's share of the host's memory, in bytes (Linux, /proc): ``rss`` counts
    every page it maps, shared or not; ``pss`` divides each shared page between the
    processes sharing it (the processes' PSS add up to what they use together);
    ``private`` are the pages no other process has (copies made after a fork among
    them)."""

    pid: int
    rss: int
    pss: int
    private: int


def process_memory(pid: int | None = None) -> ProcessMemory:
    """``ProcessMemory`` of process ``pid`` (this one by default), from Linux's
    /proc/<pid>/smaps_rollup. In a rank: the memory of the launch process it runs in.

    Args:
        pid: a process id; None: this process.

    Returns:
        A ``ProcessMemory``: its ``rss``, ``pss`` and ``private`` bytes.
    """
    pid = os.getpid() if pid is None else pid
    path = f"/proc/{pid}/smaps_rollup"
    try:
        with open(path) as file:
            fields = dict(_kilobytes(line) for line in file if line.endswith("kB\n"))
    except FileNotFoundError:
        raise TpunbError(
            f"No {path}: process memory is read from Linux's /proc (Colab, Kaggle and "
            "Binder run Linux; macOS and Windows do not have it)."
        ) from None
    private = fields["Private_Clean"] + fields["Private_Dirty"]
    return ProcessMemory(pid, fields["Rss"], fields["Pss"], private)


def _kilobytes(line):
    name, value, _unit = line.split()
    return name.rstrip(":"), int(value) * 1024
