"""``tpunb.log(loss=loss)``: inside a rank, record numbers for this step; the notebook plots
them live and the launch's ``history`` keeps them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tpunb.errors import TpunbError
from tpunb.launcher import recorder

if TYPE_CHECKING:
    import torch


def log(**values: float | torch.Tensor) -> None:
    """Records scalar metrics for this rank's current step, e.g. ``tpunb.log(loss=loss)``.

    Device tensors are not read when logged: they are read back in batches after the
    steps that computed them (about twice a second), so logging adds no sync and no
    device-to-host transfer to a step. The notebook plots them live and the launch's
    ``history`` keeps them.

    Args:
        **values: name -> a number, or a one-element tensor (on the device or not)."""
    current = recorder.current()
    if current is None:
        raise TpunbError(
            "tpunb.log(...) records metrics of a rank: call it inside the function given to "
            "tpunb.launch (or a Lightning run with tpunb's callback). In the notebook itself, "
            "keep your own values."
        )
    current.log(values)
