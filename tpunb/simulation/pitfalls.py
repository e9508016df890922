"""What a TPU would meet, found while a program's own ``xmp.spawn`` runs on simulated cores:
the report of ``python -m tpunb.simulate`` and ``pytest --tpunb-simulate``.

Where ``$TPUNB_REPORT`` names a folder (those two set it; nothing else does), each plain
launch (``xmp.spawn``, ``torch_xla.launch``; not ``tpunb.launch``, which warns as it goes) is
watched as ``tpunb.launch`` watches its own, and nothing is printed while it runs:

- each rank records its steps as a launch's rank does (``launcher/recorder.py``: the
  compilations, CPU fallbacks, batch shapes and the reads of device values that cut a
  step), into a file of the launch's own folder, and a fingerprint of the first batch of
  every DataLoader it reads;
- once the ranks have ended, the launching process judges them, and writes each finding,
  with the launch's cell (or file) and line, to ``findings.jsonl``: the compile watch's
  causes (recompilations after the warm-up, reads that cut a step, CPU fallbacks), a
  DataLoader whose first batch was the same on every rank (no ``DistributedSampler``), the
  meeting's verdict on ranks whose collective calls diverged, and a spawn after the
  program had started the XLA runtime.

``report(folder)`` reads the findings back, once each, for the command line and pytest.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import sys
import tempfile
import time
import weakref

from tpunb import machine
from tpunb.upstream import registry

FOLDER = "TPUNB_REPORT"  # where the report goes; set by the command line and pytest's plugin
_LAUNCH = "TPUNB_REPORT_LAUNCH"  # in a watched launch: its own folder, for its ranks
_FINDINGS = "findings.jsonl"
_LAUNCHES = "launches"  # a line a launch watched

# The fix for each kind of finding, after what the compile watch says.
_RUNTIME_STARTED = (
    "the XLA runtime was already started in this process when xmp.spawn was called (a "
    "cell or line before it touched the device: torch_xla.device(), a tensor or model moved "
    "there, xr.world_size(), xm.xla_device_hw(...)), so torch_xla refuses to start the "
    "cores. Move everything that touches the device into the function xmp.spawn runs, and "
    "restart the kernel."
)


def reporting() -> bool:
    """Whether plain launches are watched for the report (``$TPUNB_REPORT`` is set)."""
    return bool(os.environ.get(FOLDER))


@contextlib.contextmanager
def folder():
    """For the duration: a new report folder named in ``$TPUNB_REPORT`` (for the kernels
    and processes started meanwhile, which inherit it); yields its path."""
    with (
        tempfile.TemporaryDirectory(prefix="tpunb-report-") as path,
        machine.variable_set(FOLDER, path),
    ):
        yield path


# In the launching process -----------------------------------------------------------------


@contextlib.contextmanager
def launch_watched(ranks, meeting):
    """Around a plain launch of ``ranks`` processes (``rank_processes.run_in_meeting``),
    whose collective calls ``meeting`` judges: its ranks record what they do, and its
    findings are written once they have ended. Does nothing unless ``reporting()``, nor
    around a ``tpunb.launch``."""
    from tpunb.launcher import rank

    if not reporting() or rank.launching():
        yield
        return

    where = _launch_site()
    if machine.runtime_started():
        _write([f"{where}: {_RUNTIME_STARTED}"], ranks)
        yield
        return
    launch = tempfile.mkdtemp(prefix="launch-", dir=os.environ[FOLDER])
    try:
        with machine.variable_set(_LAUNCH, launch):
            yield
    finally:
        findings = _judged(launch, ranks)
        if meeting.verdict is not None:
            findings.append(meeting.verdict)
        _write([f"{where}: {finding}" for finding in findings], ranks)


def _launch_site():
    """The program's line that launched: "xmp.spawn at cell In[4], line 12"."""
    from tpunb import program_lines

    frame, entry = program_lines.program_frame(sys._getframe(3), program_lines.libraries())
    call = {"launch": "torch_xla.launch"}.get(entry, "xmp.spawn")
    if frame is None:
        return call
    where = program_lines.cell_or_file(frame.f_code.co_filename)
    return f"{call} at {where}, line {frame.f_lineno}"


def _judged(launch, ranks):
    """The findings of the ranks' records in the folder ``launch``."""
    from tpunb.watch import compile_watch

    watch = compile_watch.CompileWatch(ranks)
    first_batches, trained = {}, False
    for rank in range(ranks):
        for kind, record in _records(os.path.join(launch, f"rank{rank}")):
            if kind == "steps":
                steps = record.steps()
                trained |= any(s.optimizer_steps or s.epoch is not None for s in steps)
                watch.add(record.rank, steps)
            else:  # a DataLoader's first batch: (where it was built, its sampler, fingerprint)
                first_batches.setdefault(record[:2], {}).setdefault(rank, set()).add(record[2])
    watch.finish()
    # A changed graph is a training step's that runs other code than the steps before it;
    # in a program that never trains (no optimizer step, no loader's batches), each new
    # code path is just the program's next part.
    findings = [message for cause, message in watch.causes.items() if trained or cause != "graph"]
    for (built, sampler), by_rank in first_batches.items():
        alike = set.intersection(*by_rank.values())
        if len(by_rank) == ranks > 1 and alike:
            findings.append(_loader_words(built, sampler, ranks))
    return findings


def _loader_words(built, sampler, ranks):
    return (
        f"the DataLoader built at {built} gave every one of the {ranks} cores the same "
        f"batches (its sampler: {sampler}): the cores train on the same data, so {ranks} "
        "cores do the work of one. Build it inside the function xmp.spawn runs with "
        "sampler=DistributedSampler(dataset, num_replicas=xr.world_size(), "
        "rank=xr.global_ordinal(), shuffle=True), and call sampler.set_epoch(epoch) at "
        "each epoch."
    )


def _records(path):
    if not os.path.exists(path):
        return
    with open(path, "rb") as file:
        while True:
            try:
                yield pickle.load(file)
            except EOFError:
                return


def _write(findings, ranks):
    path = os.environ[FOLDER]
    with open(os.path.join(path, _LAUNCHES), "a") as file:
        file.write(f"{ranks}\n")
    if findings:
        with open(os.path.join(path, _FINDINGS), "a") as file:
            for finding in findings:
                file.write(json.dumps(finding) + "\n")


# In a rank --------------------------------------------------------------------------------


class _FileChannel:
    """Where a watched rank's recorder sends its steps: a file of the launch's folder."""

    def __init__(self, path):
        self._file = open(path, "ab")  # noqa: SIM115 - closed by the rank's ``recorded``

    def send(self, message, plain=False):
        pickle.dump(("steps", message), self._file, pickle.HIGHEST_PROTOCOL)

    def first_batch(self, record):
        pickle.dump(("batch", record), self._file, pickle.HIGHEST_PROTOCOL)

    def close(self):
        self._file.close()


_channel = None  # in a watched rank's process: its _FileChannel


@contextlib.contextmanager
def rank_watched(rank):
    """Around rank ``rank``'s function, in the thread that runs it: its steps recorded as a
    launch's rank's are, for the launching process to judge. Does nothing outside a watched
    launch."""
    global _channel
    launch = os.environ.get(_LAUNCH)
    if not launch:
        yield
        return
    from tpunb.launcher import hooks, recorder

    _channel = _FileChannel(os.path.join(launch, f"rank{rank}"))
    recording = recorder.Recorder(rank, _channel, time.monotonic(), memory=False)
    try:
        with hooks.installed(), hooks.reads_recorded():
            recorder.enter(recording)
            try:
                yield
            except BaseException:
                recording.flush_finished_steps()
                raise
            recording.finish()
    finally:
        recorder.leave()
        _channel.close()
        _channel = None


_built_at = weakref.WeakKeyDictionary()  # DataLoader -> the program's line that built it
_first = weakref.WeakKeyDictionary()  # a pass's iterator -> its loader's, till its first batch


# The registry's makers (its "loaders_read_alike" entries): installed in a reporting
# process by ``simulate``, they note where each DataLoader was built and, in a watched
# rank, the first batch of each pass over one.
def built_noted(_, init):
    @functools.wraps(init)
    def built_here(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _built_at[self] = _program_line()

    return built_here


def passes_noted(name, original):
    if name == "__init__":  # a pass's iterator, given its DataLoader

        @functools.wraps(original)
        def pass_noted(self, loader, *args, **kwargs):
            original(self, loader, *args, **kwargs)
            if _channel is not None:
                _first[self] = (_built_at.get(loader, "?"), _sampler(loader))

        return pass_noted

    @functools.wraps(original)
    def first_batch_noted(self):
        __tracebackhide__ = True  # a rank's traceback shows the program's loop, not this
        batch = original(self)
        first = _first.pop(self, None)
        if first is not None and _channel is not None:
            _channel.first_batch((*first, _fingerprint(batch)))
        return batch

    return first_batch_noted


def install():
    """Puts the DataLoader notes in place (``simulate`` does, where ``reporting()``)."""
    registry.install("loaders_read_alike")


def _program_line():
    from tpunb import program_lines

    frame, _ = program_lines.program_frame(sys._getframe(2), program_lines.libraries())
    if frame is None:
        return "?"
    return f"{program_lines.cell_or_file(frame.f_code.co_filename)}, line {frame.f_lineno}"


def _sampler(loader):
    sampler = loader.sampler
    inner = getattr(loader.batch_sampler, "sampler", None)
    if inner is not None and inner is not sampler:
        sampler = inner
    words = type(sampler).__name__
    replicas = getattr(sampler, "num_replicas", None)
    return words if replicas is None else f"{words} with num_replicas={replicas}"


def _fingerprint(batch):
    """A digest of the batch's values, for telling whether ranks read the same batch."""
    digest = hashlib.blake2b(digest_size=16)
    torch = sys.modules["torch"]

    def add(item):
        if isinstance(item, torch.Tensor):
            data = item.detach().cpu().contiguous()
            digest.update(str((data.dtype, tuple(data.shape))).encode())
            digest.update(data.view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            for key in item:
                digest.update(repr(key).encode())
                add(item[key])
        elif isinstance(item, (list, tuple)):
            for part in item:
                add(part)
        else:
            digest.update(repr(item).encode())

    add(batch)
    return digest.hexdigest()


# For the command line and pytest ------------------------------------------------------------


def report(path):
    """(launches watched, their findings once each, in the order found)."""
    launches = 0
    if os.path.exists(os.path.join(path, _LAUNCHES)):
        with open(os.path.join(path, _LAUNCHES)) as file:
            launches = len(file.read().split())
    findings = []
    if os.path.exists(os.path.join(path, _FINDINGS)):
        with open(os.path.join(path, _FINDINGS)) as file:
            findings = list(dict.fromkeys(json.loads(line) for line in file if line.strip()))
    return launches, findings


def report_lines(launches, findings):
    """The report (``report(path)``'s) as lines of text: a heading, then a numbered finding
    a line."""
    if not launches:
        return ["tpunb's report: no xmp.spawn or torch_xla.launch ran, so nothing was watched."]
    watched = f"{launches} launch{'es' if launches != 1 else ''} watched"
    if not findings:
        return [f"tpunb's report ({watched}): nothing found that a TPU would meet."]
    lines = [f"tpunb's report ({watched}): what a TPU would meet, and the fix"]
    for n, finding in enumerate(findings, 1):
        lines.append(f"{n:>3}. " + finding.replace("\n", "\n     "))
    return lines
