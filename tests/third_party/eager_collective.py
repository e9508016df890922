"""An in-place all-reduce in eager mode, as pytorch/xla's
test/eager/test_eager_all_reduce_in_place.py makes it: on a TPU the collective runs as one
eager XLA computation, which torch_xla's EagerOpExecuteTime metric counts."""

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr


def _mp_fn(index):
    torch_xla.experimental.eager_mode(True)
    device = torch_xla.device()
    as_float = torch.tensor([index], dtype=torch.float).to(device)
    as_int = torch.tensor([index], dtype=torch.int32).to(device)
    xm.wait_device_ops()
    met.clear_all()
    xm.all_reduce(xm.REDUCE_SUM, [as_float, as_int])  # a list: in place, as optimizer_step's
    xm.wait_device_ops()
    executions = met.metric_data("EagerOpExecuteTime")[0]
    lazy = (met.metric_data("ExecuteTime") or [0])[0]
    print(
        f"rank {xr.global_ordinal()}: {xm.xla_device_hw(device)}, eager executions "
        f"{executions}, lazy {lazy}, sums {as_float.item():g} {as_int.item()}",
        flush=True,
    )


if __name__ == "__main__":
    torch_xla.launch(_mp_fn, args=())
