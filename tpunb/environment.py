"""``env()``: what this notebook runs on, how a launch will lay out its cores, and what
would go wrong, with the fix. Never starts the XLA runtime and never uses the network."""

import dataclasses
import importlib.metadata
import sys

from tpunb import _rendering, hardware, platform, simulation


@dataclasses.dataclass(frozen=True, repr=False)
class Environment(_rendering.Report):
    """The environment report; shows as text in a console and as a table in a notebook."""

    platform: str
    tpu: object  # hardware.Tpu or None
    simulated_cores: object  # int or None
    python: str
    torch: object  # version string or None
    torch_xla: object  # version string or None
    runtime_started: bool
    warnings: tuple

    @property
    def cores(self):
        """XLA devices a launch runs on: one rank per core."""
        if self.tpu is not None:
            return self.tpu.cores
        return self.simulated_cores or 0

    @property
    def processes(self):
        """Processes a launch starts: one per TPU chip; one for all simulated cores."""
        if self.tpu is not None:
            return self.tpu.chips
        return 1 if self.simulated_cores else 0

    @property
    def threads_per_process(self):
        """Ranks per process, each a thread driving one core."""
        if self.tpu is not None:
            return self.tpu.cores_per_chip
        return self.simulated_cores or 0

    @property
    def accelerator(self):
        if self.tpu is not None:
            return f"TPU {self.tpu.accelerator_type} ({self.tpu.chips} chips)"
        if self.simulated_cores:
            return f"{self.simulated_cores} TPU cores simulated on the CPU"
        return "no TPU"

    def _rows(self):
        layout = (
            f"{self.processes} process{'es' if self.processes != 1 else ''} x "
            f"{self.threads_per_process} thread{'s' if self.threads_per_process != 1 else ''}"
            if self.cores
            else "-"
        )
        return [
            ("platform", self.platform),
            ("accelerator", self.accelerator),
            ("cores", str(self.cores)),
            ("launch layout", layout),
            ("XLA runtime started here", "yes" if self.runtime_started else "no"),
            ("python", self.python),
            ("torch", self.torch or "not installed"),
            ("torch_xla", self.torch_xla or "not installed"),
        ]

    def _content(self):
        return "tpunb environment", self._rows(), self.warnings


def env():
    """Report the platform, TPU (real or simulated), launch layout, versions and warnings."""
    tpu = hardware.detect()
    report = Environment(
        platform=platform.name(),
        tpu=tpu,
        simulated_cores=simulation.simulated_cores(),
        python=sys.version.split()[0],
        torch=_version("torch"),
        torch_xla=_version("torch_xla"),
        runtime_started=platform.runtime_started(),
        warnings=(),
    )
    return dataclasses.replace(report, warnings=tuple(_warnings(report)))


def _warnings(report):
    if report.runtime_started:
        yield (
            "The XLA runtime already runs in this process (the device was used before a "
            "launch), so no launch can start: restart the kernel and use the device only "
            "inside the launched function."
        )
    if report.torch_xla is None:
        yield (
            "torch_xla is not installed: pip install torch_xla[tpu] on a TPU VM, or "
            "pip install 'tpunb[sim]' to simulate cores on the CPU."
        )
    elif report.torch and _minor(report.torch) != _minor(report.torch_xla):
        yield (
            f"torch {report.torch} and torch_xla {report.torch_xla} do not match; torch_xla is "
            f"built against one torch release: pip install torch=={report.torch_xla}."
        )
    elif report.tpu is None and _minor(report.torch_xla) not in simulation.SUPPORTED_TORCH_XLA:
        yield (
            f"tpunb.simulate supports torch_xla {' and '.join(simulation.SUPPORTED_TORCH_XLA)}; "
            f"this is {report.torch_xla}."
        )
    if report.tpu is None and not report.simulated_cores:
        yield "No TPU here: call tpunb.simulate(cores=8) to simulate 8 TPU cores on the CPU."
    if report.cores == 1:
        yield (
            "Only 1 TPU core: data parallelism has nothing to split. A v2-8, v3-8 or v5e-8 "
            "has 8 cores."
        )
    if report.threads_per_process > 1:
        yield (
            f"{report.threads_per_process} ranks run as threads of each process, so they share "
            "its objects and torch's random number generator: build the model before the "
            "launch, and in each rank take copy.deepcopy(model) before .to(device)."
        )
    preset = platform.spawn_breaking_variables()
    if preset:
        names = ", ".join(f"{k}={v!r}" for k, v in preset.items())
        yield (
            f"{names} preset (Kaggle does this) would break xmp.spawn; tpunb.launch removes "
            "them for the launch. Before a plain xmp.spawn, os.environ.pop() them."
        )
    if platform.in_kernel() and sys.version_info >= (3, 12):
        yield (
            "Python 3.12+ warns that forking a multi-threaded kernel may deadlock; xmp.spawn "
            "must fork in a notebook, and the warning is expected."
        )


def _version(distribution):
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version):
    return ".".join(version.split("+")[0].split(".")[:2])
