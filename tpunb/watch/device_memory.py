"""Each core's device memory during a launch, where the device reports it.

On a TPU, torch_xla reports a device's bytes in use, its peak and its memory's size (HBM)
(``xm.get_memory_info``). XLA's CPU client does not (``GetAllocatorStats`` is
UNIMPLEMENTED), so on simulated cores device memory is not measured: nothing is shown,
and ``tpunb.memory.replica_memory`` estimates what a replica needs instead. Each rank
reads its device's use when it sends its step records (at most twice a second); the
notebook warns once a core passes 90% of its HBM, and explains an out-of-memory error
with the core's last measured use."""

from __future__ import annotations

import re
import typing

NEAR_LIMIT = 0.9
GiB = 2**30

# How XLA says a device's memory ran out: "Out of memory allocating 4398046511104 bytes."
# (a CPU client), "Ran out of memory in memory space hbm" (a TPU's compiler), "Attempting
# to allocate 20.5G. That was not possible" (a TPU's runtime). torch_xla 2.8 puts the
# status code before it ("RESOURCE_EXHAUSTED: "); 2.9 raises the message alone
# (BuildStatusErrorMessage in torch_xla/csrc/status.cpp).
_OUT_OF_MEMORY = re.compile(
    r"RESOURCE_EXHAUSTED|[Oo]ut of memory|Attempting to allocate .* That was not possible"
)


def is_out_of_memory(error_text: str) -> bool:
    """Whether a rank's error says its device ran out of memory."""
    return _OUT_OF_MEMORY.search(error_text) is not None


class Use(typing.NamedTuple):
    """A device's memory at one moment, in bytes."""

    used: int
    peak: int
    limit: int


class Reader:
    """In a rank: its device's memory, or None where the device does not report it."""

    def __init__(self) -> None:
        self._reports = True

    def read(self) -> Use | None:
        if not self._reports:
            return None
        import torch_xla

        try:
            device = str(torch_xla._XLAC._xla_get_default_device())
            info = torch_xla._XLAC._xla_memory_info(device)
        except RuntimeError:  # XLA's CPU client: "UNIMPLEMENTED: GetAllocatorStats ..."
            self._reports = False
            return None
        used = int(info["bytes_used"])
        return Use(used, int(info.get("peak_bytes_used", used)), int(info["bytes_limit"]))


def in_words(use: Use) -> str:
    """ "14.7 of 16.0 GiB (92%), peak 15.1 GiB" """
    if not use.limit:
        return f"{use.used / GiB:.1f} GiB, peak {use.peak / GiB:.1f} GiB (no limit reported)"
    return (
        f"{use.used / GiB:.1f} of {use.limit / GiB:.1f} GiB ({use.used / use.limit:.0%}), "
        f"peak {use.peak / GiB:.1f} GiB"
    )


class NearLimit:
    """In the notebook: a warning, once a launch, when a core's use passes
    ``NEAR_LIMIT`` of its memory."""

    def __init__(self) -> None:
        self._warned = False  # each core's last use is the history's (device_memory())

    def add(self, rank: int, steps: typing.Iterable[typing.Any]) -> list[str]:
        messages = []
        for step in steps:
            if step.memory is None:
                continue
            use = Use(*step.memory)
            if not self._warned and use.limit and max(use.used, use.peak) >= NEAR_LIMIT * use.limit:
                self._warned = True
                messages.append(
                    f"Core {rank} uses {in_words(use)} of its device memory at step "
                    f"{step.step + 1}: a larger batch, model or sequence will stop with "
                    "RESOURCE_EXHAUSTED. To make room: a smaller batch a core, bf16 "
                    "(torch.autocast('xla', dtype=torch.bfloat16)), or gradient "
                    "checkpointing (torch.utils.checkpoint)."
                )
        return messages


def out_of_memory(rank: int, last: Use | None) -> str:
    """What a RESOURCE_EXHAUSTED in ``rank`` means, with its last measured use."""
    measured = (
        f"Its last measured use: {in_words(last)}."
        if last is not None
        else "Its use was not measured (simulated cores: the CPU client does not report it)."
    )
    return (
        f"Core {rank} ran out of device memory (HBM). {measured} Each core holds a whole "
        "replica (weights, gradients, optimizer state) and its batch's activations: use a "
        "smaller batch a core, bf16 (torch.autocast('xla', dtype=torch.bfloat16)), or "
        "gradient checkpointing (torch.utils.checkpoint); tpunb.memory.replica_memory "
        "estimates what a replica needs before any launch."
    )
