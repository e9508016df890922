"""PyTorch Lightning on every TPU core from a notebook, with tpunb's live view.

    import tpunb.lightning
    live = tpunb.lightning.LiveCallback()
    trainer = tpunb.lightning.trainer(max_epochs=3, callbacks=[live])
    trainer.fit(model, loader)        # Lightning's own XLA strategy, fork launcher, sampler
    live.history.plot()               # per rank, per step: loss, samples/s, compilations

``trainer(...)`` builds a ``lightning.Trainer(accelerator="tpu", devices="auto", ...)``
whose launcher is Lightning's XLA launcher watched by tpunb: the notebook shows the live
view while the cores train, a failing rank stops the others with its traceback, and a
hang is reported instead of waiting forever. On one core (Colab's TPU) the rank runs in a
child process, so that the kernel can launch again. A plain ``Trainer(accelerator="tpu")``
works too (on simulated cores as well, after ``tpunb.simulate``), without
the view. Requires the ``lightning`` package (``pip install lightning``, which keeps the
installed torch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import multiprocessing
from typing import TYPE_CHECKING

from tpunb import migration
from tpunb.errors import TpunbError
from tpunb.launcher import base, one_core, preflight, rank, recorder, supervisor
from tpunb.simulation.lightning import trained_weights_back

if importlib.util.find_spec("lightning") is None:
    raise TpunbError(
        "tpunb.lightning needs PyTorch Lightning 2: pip install lightning (it keeps the "
        "torch and torch_xla already installed), then restart the kernel."
    )

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import XLAStrategy  # noqa: E402
from lightning.pytorch.strategies.launchers.xla import _XLALauncher  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from lightning.pytorch.utilities.rank_zero import rank_zero_only  # noqa: E402

__all__ = ["LiveCallback", "OneCoreXLAStrategy", "trainer"]

if TYPE_CHECKING:
    from typing import Any

# Lightning's loggers: their INFO lines (the hardware found, a cloud-logging tip, "fit
# stopped") say nothing the live view does not, and show twice in notebooks, where
# torch_xla's import adds a root handler (logging.basicConfig). Warnings still show.
LIGHTNING_LOGGERS = (
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
)


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
        steps = recorder.current()
        if steps is None:
            raise TpunbError(
                "tpunb.lightning.LiveCallback runs in a trainer built by "
                "tpunb.lightning.trainer(...), whose launcher sends the steps to the "
                "notebook. Build the trainer with it: tpunb.lightning.trainer(max_epochs=..., "
                "callbacks=[...])."
            )
        # Lightning syncs several times (barriers, broadcasts) before the first batch and
        # after the last: the compile watch counts those steps in the warm-up.
        steps.framework_steps(True)
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
        steps = recorder.current()
        steps.training_data(getattr(host, "dataset", host))
        steps.framework_steps(False)

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


def trainer(
    *, live: str | bool = "auto", hang_timeout: float | None = 600, **trainer_arguments: Any
) -> pl.Trainer:
    """A ``lightning.Trainer`` on every TPU core (or every simulated one), watched by tpunb.

    ``trainer_arguments`` go to ``lightning.Trainer``; ``accelerator`` defaults to
    ``"tpu"``, ``devices`` to ``"auto"`` (every core) and ``enable_progress_bar`` to False
    (the live view shows the progress). A ``LiveCallback`` is added unless one is in
    ``callbacks``. ``live`` and ``hang_timeout`` are ``tpunb.launch``'s. Everything that
    would break the run is refused here, before any fork.
    """
    outdated = migration.trainer_argument_error(trainer_arguments)
    if outdated:
        raise TpunbError(outdated)
    plan, mode = preflight.checked(hang_timeout=hang_timeout, view=live)
    trainer_arguments.setdefault("accelerator", "tpu")
    trainer_arguments.setdefault("devices", "auto")
    trainer_arguments.setdefault("enable_progress_bar", False)
    if plan.cores == 1:
        trainer_arguments.setdefault("strategy", OneCoreXLAStrategy())
    devices = trainer_arguments["devices"]
    if devices not in ("auto", -1, "-1", plan.cores, str(plan.cores)):
        raise TpunbError(
            f"tpunb.lightning.trainer(devices={devices!r}) runs on all {plan.cores} cores "
            "through Lightning's XLA launcher. Leave devices out (or 'auto'). A single core "
            "would run in this kernel's process and start the XLA runtime here, which no "
            "later launch could undo."
        )
    callbacks = list(trainer_arguments.pop("callbacks", None) or [])
    if not any(isinstance(callback, LiveCallback) for callback in callbacks):
        callbacks.append(LiveCallback())
    with _without_info_lines():
        built = pl.Trainer(callbacks=callbacks, **trainer_arguments)
    strategy = built.strategy
    if not isinstance(strategy.launcher, _XLALauncher):
        raise TpunbError(
            f"tpunb.lightning.trainer runs through Lightning's XLA launcher; these arguments "
            f"gave {type(strategy).__name__}. Leave strategy out (Lightning then uses 'xla')."
        )
    strategy._launcher = _WatchedXLALauncher(strategy, plan, mode, hang_timeout)
    return built


@contextlib.contextmanager
def _without_info_lines():
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class _WatchedXLALauncher(_XLALauncher):
    """Lightning's XLA launcher (xmp.spawn, fork), run by tpunb's supervisor: its ranks
    report their steps to the notebook, which draws the live view, stops every rank at the
    first failure and reports hangs."""

    def __init__(self, strategy, plan, mode, hang_timeout):
        super().__init__(strategy)
        self._plan = plan
        self._mode = mode
        self._hang_timeout = hang_timeout
        self._key = None

    def launch(self, function, *args, trainer=None, **kwargs):
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise TpunbError(
                "This trainer has already run fit(), and Lightning's fork launcher cannot fit "
                "the same Trainer twice "
                "(https://github.com/Lightning-AI/pytorch-lightning/issues/18775). Build a new "
                "one with tpunb.lightning.trainer(...) and call its fit(): the model keeps the "
                "weights trained so far, so training continues from them."
            )
        preflight.check_runtime_not_started()
        ranks = _LightningRanks(self, function, args, trainer, kwargs)
        with _without_info_lines():  # in the ranks too: the fork copies the levels
            results = supervisor.supervise(self._plan, ranks, self._hang_timeout, self._mode)
        callbacks = trainer.callbacks if trainer is not None else []
        for callback in callbacks:
            if isinstance(callback, LiveCallback):
                callback.history, callback.compiles = results.history, results.compiles
        return ranks.returned

    def _wrapping_function(self, process_idx, *arguments):
        def work(rank_number):
            return _XLALauncher._wrapping_function(self, rank_number, *arguments)

        rank.run(self._key, process_idx, work)

    def _collect_rank_zero_results(self, trainer, results):
        return trained_weights_back(_XLALauncher._collect_rank_zero_results, self, trainer, results)


class OneCoreXLAStrategy(XLAStrategy):
    """Lightning's XLA strategy on a TPU of one core (Colab's), its rank in a child process.

    For one device Lightning uses ``SingleDeviceXLAStrategy``, which trains in the calling
    process and starts the XLA runtime there as the Trainer is built: in a notebook, no
    later launch could run. ``XLAStrategy`` refuses one device under PjRT because
    ``xmp.spawn(nprocs=1)`` would run the rank in the calling process
    (https://github.com/Lightning-AI/pytorch-lightning/pull/17408); tpunb's launcher runs
    it in a child process instead (``_launch_one_core``), so one device is fine here."""

    def setup_distributed(self) -> None:
        rank_zero_only.rank = self.global_rank


class _LightningRanks(base.Launcher):
    """Starts the ranks through Lightning's own XLA launcher; keeps what it returned."""

    def __init__(self, launcher, function, args, trainer, kwargs):
        super().__init__(launcher._plan.cores)
        self.launcher = launcher
        self.call = (function, args, trainer, kwargs)
        self.returned = None

    def start(self, key):
        function, args, trainer, kwargs = self.call
        self.launcher._key = key  # pickled with the launcher into every rank
        launch = _XLALauncher.launch if self.cores > 1 else _launch_one_core
        self.returned = launch(self.launcher, function, *args, trainer=trainer, **kwargs)


def _launch_one_core(launcher, function, *args, trainer=None, **kwargs):
    """``_XLALauncher.launch`` for one core, with the rank in a forked child process.

    For one device Lightning calls ``xmp.spawn(nprocs=1)``, which runs the rank in the
    calling process: here the notebook's kernel, whose XLA runtime would then stay started
    and no later launch could run. As ``tpunb.launch`` does on one core, a child process
    makes that call, and the rank's results come back through Lightning's own queue."""
    with multiprocessing.Manager() as manager:
        results = manager.Queue()
        exitcode = one_core.in_a_child_process(
            launcher._wrapping_function, trainer, function, args, kwargs, results
        )
        if exitcode != 0:  # the rank has reported why, or the supervisor will
            raise RuntimeError(f"the process of core 0 exited with code {exitcode}")
        worker_output = results.get()
    if trainer is None:
        return worker_output
    launcher._already_fit |= trainer.state.fn == TrainerFn.FITTING
    launcher._recover_results_in_main_process(worker_output, trainer)
    return worker_output.trainer_results
