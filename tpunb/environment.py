"""``env()``: what this notebook runs on, how a launch will lay out its cores, and what
would go wrong, with the fix. Never starts the XLA runtime and never uses the network."""

from __future__ import annotations

import dataclasses
import sys

from tpunb import hardware, machine, reports, tpu_holders
from tpunb.upstream import versions

# What simulated cores cannot do as a TPU does (torch_xla's CPU runtime cannot), said once
# here and in docs/simulation.md's table, with the reasons.
SIMULATED_DIFFERENCES = (
    "a step's gradient all-reduce runs on the host, so a step runs as 2 graphs (1 on a TPU); "
    "float32 matmuls run in full float32 (a TPU's default precision rounds their inputs to "
    "bfloat16: the low bits differ); a saved compilation cache (xr.initialize_cache) is "
    "never loaded back. More in docs/simulation.md."
)


@dataclasses.dataclass(frozen=True, repr=False)
class Environment(reports.Report):
    """The environment report; shows as text in a console and as a table in a notebook."""

    platform: str
    layout: object  # machine.Layout, or None without a TPU or a simulation
    host_tpu: object  # hardware.Tpu on PCI, or None: the TPU even where cores are simulated
    python: str
    torch: object  # version string or None
    torch_xla: object  # version string or None
    runtime_started: bool
    holders: tuple  # tpu_holders.Holder: other processes holding this host's TPU
    warnings: tuple

    @property
    def tpu(self) -> hardware.Tpu | None:
        """The TPU (``hardware.Tpu``), or None."""
        return self.layout.tpu if self.layout else None

    @property
    def simulated_cores(self) -> int | None:
        return self.layout.cores if self.layout and self.layout.simulated else None

    @property
    def cores(self) -> int:
        """XLA devices a launch runs on: one rank per core."""
        return self.layout.cores if self.layout else 0

    @property
    def processes(self) -> int:
        """Processes a launch starts: one per TPU chip, one per simulated core."""
        return self.layout.processes if self.layout else 0

    @property
    def threads_per_process(self) -> int:
        """Ranks per process, each a thread driving one core."""
        return self.layout.ranks_per_process if self.layout else 0

    @property
    def accelerator(self) -> str:
        if self.tpu is not None:
            return f"TPU {self.tpu.accelerator_type} ({self.tpu.chips} chips)"
        if self.simulated_cores:
            simulated = f"{self.simulated_cores} TPU cores simulated on the CPU"
            if self.host_tpu is not None:
                simulated += f" instead of this host's TPU {self.host_tpu.accelerator_type}"
            return simulated
        return "no TPU"

    def _rows(self):
        return (
            [
                ("platform", self.platform),
                ("accelerator", self.accelerator),
                ("cores", str(self.cores)),
                ("launch layout", self._layout_text()),
                ("XLA runtime started here", "yes" if self.runtime_started else "no"),
            ]
            + ([("TPU held by", self._holders_text())] if self.host_tpu else [])
            + [
                ("python", self.python),
                ("torch", self.torch or "not installed"),
                ("torch_xla", self.torch_xla or "not installed"),
            ]
            + ([("unlike a TPU", SIMULATED_DIFFERENCES)] if self.simulated_cores else [])
        )

    def _holders_text(self):
        if not self.holders:
            return "no other process: the TPU is free"
        return tpu_holders.described(self.holders)

    def _layout_text(self):
        if self.layout is None:
            return "-"
        text = self.layout.describe()
        return f"{text}: a process a core, as on a TPU v5e" if self.layout.simulated else text

    def _content(self):
        return "tpunb environment", self._rows(), self.warnings


def env() -> Environment:
    """Report the platform, TPU (real or simulated), launch layout, versions and warnings.

    Returns:
        An ``Environment`` (shown as a table in a notebook; ``.cores``, ``.warnings``...).
    """
    report = Environment(
        platform=machine.platform(),
        layout=machine.available(),
        host_tpu=hardware.detect(),
        python=sys.version.split()[0],
        torch=versions.installed("torch"),
        torch_xla=versions.installed("torch_xla"),
        runtime_started=machine.runtime_started(),
        holders=(),
        warnings=(),
    )
    if report.host_tpu is not None:  # without a TPU, /dev/vfio is some other device's
        report = dataclasses.replace(report, holders=tuple(tpu_holders.find()))
    return dataclasses.replace(report, warnings=tuple(_warnings(report)))


def _warnings(report):
    if report.holders:
        yield tpu_holders.advice(report.holders)
    if report.runtime_started:
        yield (
            "The XLA runtime already runs in this process (the device was used before a "
            "launch), so no launch can start: restart the kernel and use the device only "
            "inside the launched function."
        )
    torch_tpu = versions.installed("torch_tpu")
    if torch_tpu is not None:
        yield versions.TORCH_TPU.format(version=torch_tpu)
    if report.torch_xla is None:
        if torch_tpu is None:
            yield versions.INSTALL_TORCH_XLA
    elif report.torch and versions.minor(report.torch) != versions.minor(report.torch_xla):
        yield (
            f"torch {report.torch} and torch_xla {report.torch_xla} do not match; torch_xla is "
            f"built against one torch release: pip install torch=={report.torch_xla}."
        )
    elif report.tpu is None and not versions.simulation_supports(report.torch_xla):
        yield (
            f"tpunb.simulate supports torch_xla {' and '.join(versions.SUPPORTED_TORCH_XLA)}; "
            f"this is {report.torch_xla}."
        )
    if report.layout is None:
        yield "No TPU here: call tpunb.simulate(cores=8) to simulate 8 TPU cores on the CPU."
    if report.cores == 1 and report.tpu is not None:
        yield (
            "Only 1 TPU core (Colab's TPU is a v5e-1 or a v6e-1): data parallelism has nothing "
            "to split here. Kaggle's TPU, a v5e-8, has 8. To watch 8 cores in this notebook, "
            "simulate them on the host's CPU instead of the TPU (far slower): "
            "tpunb.simulate(cores=8, instead_of_tpu=True)."
        )
    if report.threads_per_process > 1:
        yield (
            f"This TPU runs {report.threads_per_process} cores a process (threads sharing its "
            "objects and torch's random number generator): tpunb.launch runs only where each "
            "core has its process (v4 and later), or one core (cores=1); call torch_xla's "
            "xmp.spawn directly here."
        )
    preset = machine.spawn_breaking_variables()
    if preset and report.tpu is not None:  # simulated cores never read them
        names = ", ".join(f"{k}={v!r}" for k, v in preset.items())
        yield (
            f"{names} preset (Kaggle does this) would break xmp.spawn; tpunb.launch removes "
            "them for the launch. Before a plain xmp.spawn, os.environ.pop() them."
        )
