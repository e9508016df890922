"""What a TPU program asks at a rank's start, written for torch_xla only: the hardware it
runs on, and torch_xla's metrics before it has done anything. Like many TPU notebooks, it
sets PJRT_DEVICE itself."""

import os

os.environ["PJRT_DEVICE"] = "TPU"

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402


def report(index):
    fallbacks = met.executed_fallback_ops()
    transfers = met.counter_value("xla::_to_cpu")
    device = torch_xla.device()
    hardware = xm.xla_device_hw(device)
    with torch.autocast("xla", dtype=torch.bfloat16):  # TPU autocast: bfloat16 matmuls
        product = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
    print(
        f"rank {index}: fallbacks {fallbacks}, transfers {transfers}, hardware {hardware}, "
        f"device type {xr.device_type()}, autocast {product.dtype}",
        flush=True,
    )


if __name__ == "__main__":
    if xr.device_type() in ("TPU", "GPU"):  # as TPU examples gate their work
        torch_xla.launch(report)
    else:
        print("no TPU: nothing to do")
