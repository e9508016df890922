"""Spellings from older torch_xla and PyTorch Lightning tutorials, and the current ones.

Pasted tutorials fail with errors that do not say what replaced the call (torch_xla has
removed ``xm.xrt_world_size``, ``xm.get_ordinal`` and ``xm.xrt_device_count``: 2.8 has none
of them; Lightning 2.0 removed ``Trainer(tpu_cores=...)``). Where tpunb sees such an error
or argument, it adds the fix.
"""

# Removed torch_xla.core.xla_model names -> what to write instead.
XLA_MODEL_RENAMES = {
    "xrt_world_size": "torch_xla.runtime.world_size()",
    "get_ordinal": "torch_xla.runtime.global_ordinal()",
    "xrt_device_count": "torch_xla.runtime.addressable_device_count()",
}

# Removed Trainer(...) arguments -> what to write instead.
TRAINER_RENAMES = {
    "tpu_cores": 'accelerator="tpu", devices={value!r}',
    "num_tpu_cores": 'accelerator="tpu", devices={value!r}',
}

# Strategy names Lightning 1.x used for TPUs; 2.x calls the strategy "xla".
TRAINER_STRATEGY_RENAMES = {"tpu_spawn": "xla", "tpu_spawn_debug": "xla_debug", "xla_spawn": "xla"}


def hint_for_error(text):
    """The current spelling for an error message that names a removed call, or None."""
    for old, new in XLA_MODEL_RENAMES.items():
        if f"has no attribute '{old}'" in text:
            return (
                f"xm.{old}() comes from an older torch_xla tutorial; it was removed. "
                f"Write {new} instead (import torch_xla.runtime as xr)."
            )
    for old in TRAINER_RENAMES:
        if f"unexpected keyword argument '{old}'" in text:
            return _old_trainer_argument(old, "...", 8)  # the value is not in the message
    return None


def trainer_argument_error(kwargs):
    """What is wrong with old-style ``Trainer`` arguments in ``kwargs``, or None."""
    for old in TRAINER_RENAMES:
        if old in kwargs:
            return _old_trainer_argument(old, repr(kwargs[old]), kwargs[old])
    strategy = kwargs.get("strategy")
    if isinstance(strategy, str) and strategy in TRAINER_STRATEGY_RENAMES:
        return (
            f'Trainer(strategy="{strategy}") is PyTorch Lightning 1.x; Lightning 2 calls it '
            f'strategy="{TRAINER_STRATEGY_RENAMES[strategy]}" (the default for '
            'accelerator="tpu", so it can be left out).'
        )
    return None


def _old_trainer_argument(old, written, value):
    new = TRAINER_RENAMES[old].format(value=value)
    return (
        f"Trainer({old}={written}) is PyTorch Lightning 1.x; Lightning 2 spells it Trainer({new})."
    )
