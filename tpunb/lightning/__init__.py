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
import importlib.util
import logging
import multiprocessing
from typing import TYPE_CHECKING

from tpunb import errors, upstream
from tpunb.errors import TpunbError, warn
from tpunb.launcher import launchers, preflight, rank, supervisor
from tpunb.upstream import versions

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

from tpunb.lightning.callback import LiveCallback  # noqa: E402

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


def trainer(
    *, live: str | bool = "auto", hang_timeout: float | None = 600, **trainer_arguments: Any
) -> pl.Trainer:
    """A ``lightning.Trainer`` on every TPU core (or every simulated one), watched by tpunb.

    ``trainer_arguments`` go to ``lightning.Trainer``; ``accelerator`` defaults to
    ``"tpu"``, ``devices`` to ``"auto"`` (every core) and ``enable_progress_bar`` to False
    (the live view shows the progress). A ``LiveCallback`` is added unless one is in
    ``callbacks``. ``live`` and ``hang_timeout`` are ``tpunb.launch``'s. Everything that
    would break the run is refused here, before any fork.

    Args:
        live: what the notebook shows meanwhile, as in ``tpunb.launch``.
        hang_timeout: seconds without a finished step before the run is stopped.
        **trainer_arguments: ``lightning.Trainer``'s.

    Returns:
        The ``lightning.Trainer``; call its ``fit`` once.
    """
    outdated = errors.trainer_argument_error(trainer_arguments)
    if outdated:
        raise TpunbError(outdated)
    upstream.check(upstream.LIGHTNING, "tpunb.lightning")
    version = versions.installed("lightning")
    if version is not None and not versions.lightning_supported(version):
        low, high = versions.SUPPORTED_LIGHTNING
        warn(
            f"lightning {version} is outside the releases tpunb.lightning is checked against "
            f"({low} to {high}); the private names it uses are there, but what Lightning "
            "does with them may differ."
        )
    plan = preflight.checked(hang_timeout=hang_timeout, view=live)
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
    strategy._launcher = _WatchedXLALauncher(strategy, plan)
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

    def __init__(self, strategy, plan):
        super().__init__(strategy)
        self._plan = plan
        self._key = None

    def launch(self, function, *args, trainer=None, **kwargs):
        if self._already_fit and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise TpunbError(
                "This trainer has already run fit(), and Lightning's fork launcher cannot fit "
                "the same Trainer twice "
                "(https://github.com/Lightning-AI/pytorch-lightning/issues/18775). Build a new "
                "one with tpunb.lightning.trainer(...). Its fit(model, ...) starts from the "
                "model's trained weights but with a new optimizer and epoch 0; to resume "
                "the optimizer's state and the epoch too, give it a checkpoint: "
                "fit(model, ..., ckpt_path=...) (ModelCheckpoint(save_last=True) writes one)."
            )
        preflight.check_runtime_not_started()
        ranks = _LightningRanks(self, function, args, trainer, kwargs)
        with _without_info_lines():  # in the ranks too: the fork copies the levels
            results = supervisor.supervise(self._plan, ranks)
        callbacks = trainer.callbacks if trainer is not None else []
        for callback in callbacks:
            if isinstance(callback, LiveCallback):
                callback.history, callback.compiles = results.history, results.compiles
        return ranks.returned

    def _wrapping_function(self, process_idx, *arguments):
        def work(rank_number):
            return _XLALauncher._wrapping_function(self, rank_number, *arguments)

        rank.run(self._key, process_idx, work)


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


class _LightningRanks(launchers.Launcher):
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
        exitcode = launchers.in_a_child_process(
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
