"""Everything checked before a fork: a launch that would break is refused here, with the
fix, before any process starts. ``checked`` is the one entry point: ``tpunb.launch`` and
``tpunb.lightning.trainer`` both go through it."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from typing import TYPE_CHECKING

from tpunb import machine, upstream
from tpunb.errors import TpunbError, warn
from tpunb.upstream import registry, versions
from tpunb.watch import live

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


# What a launch can watch (launcher/watchers.py): a plan may leave any of them out.
WATCHERS = ("compiles", "reads", "collectives", "memory")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a launch is: where it runs, how long a step may take, what the notebook
    shows, and what it watches."""

    cores: int  # ranks the launch runs: all cores, or 1, each in a process of its own
    simulated: bool
    hang_timeout: float | None = 600  # seconds without a finished step (None: forever)
    view: str = "off"  # the live view's mode (live.resolve)
    unwatched: frozenset = frozenset()  # watchers left out, of WATCHERS
    # Whether torch_xla is as tpunb was checked against, so that the launch may patch its
    # loader and helpers (upstream/__init__.py); False: steps and results only.
    checked: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.unwatched) - set(WATCHERS)
        if unknown:
            raise ValueError(f"no watchers called {sorted(unknown)}: they are {WATCHERS}")

    def watches(self, watcher: str) -> bool:
        """Whether the launch watches ``watcher`` (one of ``WATCHERS``)."""
        if watcher not in WATCHERS:
            raise ValueError(f"no watcher called {watcher!r}: they are {WATCHERS}")
        return watcher not in self.unwatched


def checked(
    requested: int | None = None,
    *,
    hang_timeout: float | None,
    view: str | bool,
    start_method: str = "fork",
    fn: Callable[..., Any] | None = None,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
) -> Plan:
    """Every check before a launch of ``requested`` cores (None: all): the start method,
    ``fn(rank, *args, **kwargs)`` if given (a launch; Lightning brings its own function),
    the hang time-out, the live view's mode ``view`` (``live.resolve``), the cores (``plan``)
    and the DataLoader worker processes in the arguments. Returns the ``Plan``; raises
    ``TpunbError`` (or warns) before anything is started."""
    check_start_method(start_method)
    if fn is not None:
        check_callable(fn, args, kwargs or {})
    check_hang_timeout(hang_timeout)
    mode = live.resolve(view)
    launch_plan = plan(requested)
    warn_about_worker_processes(launch_plan, args, kwargs or {})
    return dataclasses.replace(launch_plan, hang_timeout=hang_timeout, view=mode)


def plan(requested=None):
    """The cores a launch of ``requested`` cores (None: all) runs on; refuses what
    ``xmp.spawn`` cannot run: no TPU and no simulation, a runtime already started here,
    a core count other than all or 1, a TPU that runs two cores a process (v2, v3)."""
    if not versions.has_torch_xla():
        raise TpunbError(versions.INSTALL_TORCH_XLA)
    check_runtime_not_started()
    layout = machine.available()
    if layout is None:
        raise TpunbError(
            "No TPU found on this machine, and no simulation is set up. To run on 8 TPU cores "
            "simulated on the CPU, call tpunb.simulate(cores=8) before tpunb.launch(...). "
            "On Colab or Kaggle, pick a TPU runtime/accelerator first."
        )
    # Imports torch_xla: once a TPU or a simulation has set its device (PJRT_DEVICE).
    unchecked = upstream.problems(upstream.LAUNCH, (registry.LAUNCH,))
    if unchecked:
        warn(
            f"torch_xla {versions.installed('torch_xla')} differs from the releases tpunb is "
            f"checked against ({' and '.join(versions.SUPPORTED_TORCH_XLA)}): "
            f"{', '.join(unchecked)}. The launch runs, its results and failures reported, "
            "without tpunb's watch of compilations, reads, collectives and device memory "
            "(the live view shows the logged values)."
        )
    unwatched = frozenset(WATCHERS) if unchecked else frozenset()
    checked = not unchecked
    if requested == 1 and not isinstance(requested, bool):
        return Plan(1, layout.simulated, unwatched=unwatched, checked=checked)
    if requested is None or requested == layout.cores:
        if layout.ranks_per_process > 1:
            raise TpunbError(
                f"This {layout.tpu.accelerator_type} runs {layout.describe()}: two cores share "
                "each process, and tpunb launches one core a process, as every TPU Colab and "
                "Kaggle offer today does (v5e, v6e). Launch one core to debug "
                "(tpunb.launch(fn, cores=1)), or call torch_xla's xmp.spawn directly."
            )
        return Plan(layout.cores, layout.simulated, unwatched=unwatched, checked=checked)
    where = (
        "simulated cores" if layout.simulated else f"cores on this {layout.tpu.accelerator_type}"
    )
    hint = (
        f" To simulate {requested} cores, call tpunb.simulate(cores={requested}) first."
        if layout.simulated and isinstance(requested, int) and requested > 1
        else ""
    )
    raise TpunbError(
        f"launch(cores={requested!r}): xmp.spawn runs on all {layout.cores} {where} or on 1, "
        f"nothing in between. Use cores=None (all) or cores=1 (debugging).{hint}"
    )


def check_runtime_not_started():
    if not machine.runtime_started():
        return
    restart = "Restart the kernel" if machine.in_kernel() else "Start a new Python process"
    raise TpunbError(
        "The XLA runtime is already running in this process, so xmp.spawn cannot start the "
        "cores: something here used the XLA device, e.g. torch_xla.device(), "
        "xm.xla_device(), torch_xla.device_count(), xr.world_size() outside a launch, "
        "met.metrics_report(), or a tensor moved to 'xla'. The runtime cannot be stopped. "
        f"{restart}, and touch the device only inside the function you launch."
    )


def check_start_method(start_method):
    if start_method == "fork":
        return
    why = (
        "In a notebook, spawned processes cannot find the functions defined in it "
        "(https://github.com/pytorch/xla/issues/2750). "
        if machine.in_kernel()
        else ""
    )
    raise TpunbError(
        f"launch(start_method={start_method!r}): tpunb always forks, which is what lets "
        f"functions defined in a notebook, closures and lambdas run on the cores. {why}"
        "Leave start_method out; outside a notebook, call torch_xla's xmp.spawn directly "
        "to use another start method."
    )


def check_hang_timeout(hang_timeout):
    if hang_timeout is None:
        return
    if (
        isinstance(hang_timeout, bool)
        or not isinstance(hang_timeout, (int, float))
        or hang_timeout <= 0
    ):
        raise TpunbError(
            f"launch(hang_timeout={hang_timeout!r}): give the seconds a launch may go without "
            "any rank finishing a step before it is stopped, e.g. 600, or None to never stop it."
        )


def check_callable(fn, args, kwargs):
    if not callable(fn):
        raise TpunbError(
            f"launch(fn, ...) needs a function to run on every core, got {type(fn).__name__} "
            f"{fn!r}. Pass the function itself: tpunb.launch(train, config), not train(...)."
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    try:
        signature.bind(0, *args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TpunbError(
            f"{name}{signature} cannot be called as {name}(rank, *args, **kwargs) with the "
            f"arguments given to launch ({error}). The first parameter receives the core's "
            "rank (0, 1, ...), e.g. def train(rank, config): ..."
        ) from None


def warn_about_worker_processes(plan, args, kwargs):
    """A DataLoader argument whose workers each rank would fork, where that costs: more
    workers than the host has CPUs. Warned, with the cost."""
    cpus = os.cpu_count() or 1
    for loader in [a for a in (*args, *kwargs.values()) if _forks_workers(a)]:
        workers = loader.num_workers
        if plan.cores * workers <= cpus:
            continue  # as torch_xla's own examples run them
        warn(
            f"A DataLoader with num_workers={workers} is passed to launch: each of the "
            f"{plan.cores} ranks will fork {workers} worker processes from its own forked "
            f"process ({plan.cores * workers} in all, on {cpus} CPUs). The workers compete "
            "with the ranks for the CPU. For data "
            "already in memory use num_workers=0; otherwise keep ranks x workers within the "
            "host's CPUs."
        )


def _forks_workers(obj):
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(obj, data.DataLoader) or obj.num_workers == 0:
        return False
    context = obj.multiprocessing_context
    method = context if isinstance(context, str) or context is None else context.get_start_method()
    return method in (None, "fork")
