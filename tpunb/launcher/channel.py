"""Messages from the ranks to the notebook process, sent by value, as typed records: every
message sent over a launch's channel is one of these (and nothing else is).

    Steps     a rank's finished steps (``history.Step``'s fields), sent in batches while it runs
    Raised    a rank's error, with its traceback, or a result that cannot be sent back
    Returned  a rank's result, once it has returned
    Ended     put in the notebook's own inbox when the launcher returned (never sent)

One pipe per launch, created before the fork so every rank inherits it; a lock keeps
messages from different ranks whole. Everything is pickled with plain ``pickle``: torch's
multiprocessing reductions would share tensor storage by file descriptor, which fails
with FileNotFoundError once the rank's process has exited. Tensors on an XLA device are
moved to the CPU in the rank, since rebuilding them in the parent would start the XLA
runtime there.
"""

import dataclasses
import io
import multiprocessing
import operator
import pickle
import queue
import sys
import threading
import typing

from tpunb.watch.history import Step

_STEP_FIELDS = operator.attrgetter(*(field.name for field in dataclasses.fields(Step)))


class Steps(typing.NamedTuple):
    """Sent as each step's fields: a tuple pickles in half the time a record takes, in the
    rank and in the notebook."""

    rank: int
    fields: list[tuple]  # each step's fields, in order

    @classmethod
    def of(cls, rank, steps):
        return cls(rank, [_STEP_FIELDS(step) for step in steps])

    def steps(self):
        """The ``history.Step`` records, in order."""
        return [Step(*fields) for fields in self.fields]


class Raised(typing.NamedTuple):
    rank: int
    description: str  # "raised ValueError: ...", with the likely cause when known
    traceback: str | None  # the rank's own traceback text; None when it did not raise
    # RankEnded, CollectiveMismatch: stopped by the simulation's checks, not the cause
    consequence: bool = False


class Returned(typing.NamedTuple):
    results: list  # (rank, pickled result)


class Ended(typing.NamedTuple):
    error: str | None  # what the launcher raised, if it did


class Channel:
    """Ranks ``send``; the parent's reader thread puts each message in ``inbox``."""

    def __init__(self):
        context = multiprocessing.get_context("fork")
        self._receiver, self._sender = context.Pipe(duplex=False)
        self._lock = context.Lock()
        self.inbox = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="tpunb-channel", daemon=True)

    def send(self, message, plain=False):
        """Called in a rank: pickles ``message`` by value and writes it whole. ``plain``:
        it holds no tensor (plain pickle, without a Python call for every object)."""
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL) if plain else dumps(message)
        with self._lock:
            self._sender.send_bytes(data)

    def start(self):
        self._reader.start()

    def finish(self, timeout=5.0):
        """Called in the parent once no rank runs: reads what is left, then closes the pipe."""
        self._sender.close()
        self._reader.join(timeout)
        if not self._reader.is_alive():
            self._receiver.close()

    def _read(self):
        while True:
            try:
                data = self._receiver.recv_bytes()
            except (EOFError, OSError):
                return
            self.inbox.put(pickle.loads(data))


class _ByValuePickler(pickle.Pickler):
    synced = False

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.device.type == "cpu" and (obj.is_leaf or not obj.requires_grad):
            return NotImplemented
        if obj.device.type == "xla" and not self.synced:
            # Run the device work still pending (through torch_xla.sync, so collectives
            # complete on simulated cores) before the first value is read back.
            import torch_xla

            torch_xla.sync()
            self.synced = True
        if isinstance(obj, torch.nn.Parameter):
            return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
        return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def dumps(obj):
    """``pickle.dumps`` with every tensor sent by value and on the CPU."""
    buffer = io.BytesIO()
    _ByValuePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
