"""``tpunb.lightning.LiveCallback``: what a Lightning run tells tpunb (each training step's
loss, the values logged with ``self.log`` in a training batch, the training loader's
batches), for the live view, the history and the compile watch. Needs the ``lightning``
package; ``tpunb.lightning`` checks for it and is where users take the callback from."""

from __future__ import annotations

import functools

import lightning.pytorch as pl

from tpunb.errors import TpunbError
from tpunb.launcher import recorder


class LiveCallback(pl.Callback):
    """Feeds tpunb from a Lightning run: each training step's loss and the values logged
    with ``self.log`` in a training batch go to ``tpunb.log``, and the training loader's
    batches, compilations and samples/s to the history and the compile watch.

    Use it in a trainer built by ``tpunb.lightning.trainer(...)``. After ``fit``,
    ``history`` (a ``tpunb.History``) and ``compiles`` (a ``tpunb.CompileSummary``) hold
    the run, as a launch's results do.
    """

    # Lightning calls each hook of every callback, through its profiler, at every batch;
    # it skips a hook that is not callable (``_call_callback_hooks`` in
    # lightning/pytorch/trainer/call.py). This one has no per-batch hook: the module's
    # training_step, wrapped for the run, marks and records each training batch (two
    # hooks cost 1.3% of the ranks' GIL in that dispatch; docs/simulation.md).
    on_train_batch_start = on_train_batch_end = None
    on_before_zero_grad = on_before_backward = on_after_backward = None
    on_before_optimizer_step = None
    on_validation_batch_start = on_validation_batch_end = None
    on_test_batch_start = on_test_batch_end = on_predict_batch_start = on_predict_batch_end = None

    def __init__(self) -> None:
        self.history = None
        self.compiles = None
        # From a training_step's start to Lightning's next own steps (validation, the end
        # of an epoch or of training): values given to self.log then are the batch's.
        self._in_training = False
        self._in_step = None  # in a training_step: name -> value given to self.log

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        recording = recorder.current()
        if recording is None:
            raise TpunbError(
                "tpunb.lightning.LiveCallback runs in a trainer built by "
                "tpunb.lightning.trainer(...), whose launcher sends the steps to the "
                "notebook. Build the trainer with it: tpunb.lightning.trainer(max_epochs=..., "
                "callbacks=[...])."
            )
        # Lightning syncs several times (barriers, broadcasts) before the first batch and
        # after the last: the compile watch counts those steps in the warm-up.
        recording.framework_steps(True)
        # The values the training step logs, as given: Lightning's trainer.callback_metrics
        # would turn those logged with prog_bar=True into Python numbers (.item()), a sync
        # in every step. Only in this rank's copy of the module, for the run.
        pl_module.log = _Logging(pl_module.log, self)
        pl_module.training_step = _recording(pl_module.training_step, self)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(vars(pl_module).get("log"), _Logging):
            del pl_module.log
        if getattr(vars(pl_module).get("training_step"), "records_for", None) is self:
            del pl_module.training_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's sanity check reads the validation loader first: name the training one.
        loader = trainer.train_dataloader
        host = getattr(loader, "_loader", loader)  # the DataLoader in the MpDeviceLoader
        recording = recorder.current()
        recording.training_data(getattr(host, "dataset", host))
        recording.framework_steps(False)

    # Lightning's own steps between the batches (validation, the end of an epoch) and
    # after the last: the compile watch expects them to compile once and does not judge them.
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._framework_steps()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._framework_steps()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._framework_steps()

    def _framework_steps(self):
        self._in_training = False
        recorder.current().framework_steps(True)

    def _training_step_starts(self):
        recorder.current().framework_steps(False)
        self._in_training = True
        self._in_step = {}

    def _training_step_returned(self, output):
        logged, self._in_step = self._in_step, None
        # Its loss (a tensor, or a dict's "loss": Lightning's contract) first, as shown.
        loss = output.get("loss") if isinstance(output, dict) else output
        values = {"loss": loss} if _one_number(loss) else {}
        values.update((name, value) for name, value in logged.items() if name not in values)
        if values:
            recorder.current().log(values)

    def _logged_value(self, name, value, on_step):
        """A value given to ``self.log``: recorded in the current step when it is one number
        a step (Lightning's default in a training batch: ``on_step=True``)."""
        if not self._in_training or on_step is False:
            return
        value = getattr(value, "_forward_cache", value)  # a torchmetrics Metric: this batch's
        if not _one_number(value):
            return
        if self._in_step is not None:
            self._in_step[name] = value  # recorded with the loss, after it
        else:  # after the training_step, in the same batch
            recorder.current().log({name: value})


def _one_number(value):
    if isinstance(value, (int, float)):
        return not isinstance(value, bool)
    return getattr(value, "numel", None) is not None and value.numel() == 1


def _recording(training_step, callback):
    """The module's ``training_step`` that marks a training batch for ``callback`` and
    records the loss it returns, in the step that computes it."""

    @functools.wraps(training_step)  # Lightning reads its signature (dataloader_iter)
    def training_step_recorded(*args, **kwargs):
        callback._training_step_starts()
        output = training_step(*args, **kwargs)
        callback._training_step_returned(output)
        return output

    training_step_recorded.records_for = callback
    return training_step_recorded


class _Logging:
    """``LightningModule.log`` that also hands each value to a ``LiveCallback``."""

    def __init__(self, log, callback):
        self.log = log
        self.callback = callback

    def __call__(self, name, value, prog_bar=False, logger=None, on_step=None, *more, **options):
        self.log(name, value, prog_bar, logger, on_step, *more, **options)
        self.callback._logged_value(name, value, on_step)
