"""How the processes of simulated cores exchange what their collectives carry: shared memory
for the data, a ``torch.distributed.TCPStore`` served by the launching process to meet.

Used only by the simulation's rank processes (rank_processes.py). The launching process opens a
``Meeting`` before ``xmp.spawn`` starts the ranks and closes it after: a TCPStore on the
loopback and a small shared-memory directory. The ranks, forked or spawned, find both
through the environment variable ``MEETING``. A rank first waits until every rank's process
has joined (``Exchange.join``, the first round), as a TPU process's runtime waits for the
host's other processes. Then ``Exchange.share(description, tensors)`` is one round of a
collective:

1. the rank writes its call's description and its tensors' bytes into its own
   shared-memory segment, and their lengths into its slot of the directory;
2. it waits until every rank has written (``_meet``: a counter in the store, then a key the
   last rank to arrive sets);
3. it reads every rank's description and bytes.

Each rank writes the rounds into two segments in turn, so nothing waits after the reads: a
rank writes a segment again two rounds later, after every rank has met it in the round
between, and so has finished reading. A segment too small for a round is replaced by a
larger one (its name's last number grows); the old one is unlinked at once.

Point-to-point messages (``xm.send``, ``xm.recv``) go through the store (``post``, ``take``).

The collectives only wait, as a TPU's do, or report a rank that has ended:

- A rank that raises says so in the store (``end``) and sets the key of the round it will
  never reach: the ranks waiting there stop with ``RankEnded``, naming it (with its
  exception when it pickles). For a killed rank the meeting, looking at the processes five
  times a second, says it.
- Ranks whose calls differ (their calls' identities, shared with each round), and ranks
  that wait for a rank that returned, wait for a verdict. Where no launch judges the ranks'
  calls (a plain ``xmp.spawn``, torchrun), the meeting does, with the one judge
  (watch/collective_calls.py) and the ledger the ranks write their calls to (a segment of
  the meeting's): once no rank is running, the waiting ranks raise its verdict, a
  ``CollectiveMismatch`` that names each rank's call and line. In a launch, the launch's
  own judge stops them.

The launching process unlinks every segment of the meeting as it closes.
"""

import contextlib
import datetime
import os
import pickle
import struct
import threading
import time
import uuid
from multiprocessing import shared_memory

import numpy as np

from tpunb import machine
from tpunb.errors import CollectiveMismatch, RankEnded
from tpunb.reports import ranks_named
from tpunb.upstream import registry
from tpunb.watch import collective_calls

MEETING = "TPUNB_SIMULATION_MEETING"  # "host:port:prefix", set by the launching process
# The directory, per rank: for each of its two segments the generation and the lengths of
# the description and data in it; then its pid, its rounds so far and its state.
_SEGMENT = struct.Struct("<qqq")
_STATE = struct.Struct("<qqq")
_RANK_SIZE = 2 * _SEGMENT.size + _STATE.size
_RUNNING, _ENDED_STATE, _WAITING = 0, 1, 2  # a rank's state: waiting for a verdict
_ENDED = b"ended"  # a round's key, or the verdict, set to this: a rank will never arrive
_LOOK_EVERY = 0.2  # seconds between the meeting's looks at the rank processes
_POLL = 0.005  # seconds between a recv's looks at its mailbox
_SHM_DIRECTORY = "/dev/shm"


def _untracked(name, create=False, size=0):
    """A shared-memory segment that multiprocessing's resource tracker does not follow: its
    owner is the meeting (Python 3.13's ``track=False``; before, registering is skipped)."""
    try:
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    except TypeError:  # Python < 3.13
        with registry.during("untracked_shared_memory"):
            return shared_memory.SharedMemory(name, create=create, size=size)


def register_nothing(_, register):
    """The registry's maker: a ``register`` that registers nothing."""
    return lambda name, rtype: None


def _unlink(name):
    """Removes a segment of the meeting's. Not ``SharedMemory.unlink``: before Python 3.13
    it tells the resource tracker to forget a segment it was never told of, and the tracker
    prints a ``KeyError`` traceback for each (``resource_tracker.unregister``)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_SHM_DIRECTORY, name))


class Meeting:
    """The launching process's side: where ``ranks`` processes meet, for one launch.
    ``judging``: whether it judges the ranks' collective calls (no launch does)."""

    def __init__(self, ranks, judging=True):
        from torch.distributed import TCPStore

        self.prefix = f"tpunb-{uuid.uuid4().hex[:12]}"
        self.store = TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(days=1), wait_for_workers=False
        )
        self.directory = _untracked(self.prefix, create=True, size=_RANK_SIZE * ranks)
        self.directory.buf[:] = bytes(self.directory.size)
        self.calls = _untracked(
            f"{self.prefix}-calls", create=True, size=collective_calls.Ledger.size(ranks)
        )
        self.address = f"127.0.0.1:{self.store.port}:{self.prefix}"
        self.ranks = ranks
        self.judging = judging
        self.verdict = None  # the judge's words on ranks whose calls could never meet
        self.store.set("judging", b"1" if judging else b"")
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._watch_the_ranks, daemon=True)
        self._watch.start()

    def _watch_the_ranks(self):
        """A rank process that exits before its rank ended (killed) says nothing: the ranks
        waiting for it are told here, as if it had raised. Once no rank runs and some wait
        for a verdict, the meeting gives it, if it judges."""
        told, judged = set(), False
        while not self._closed.wait(_LOOK_EVERY):
            states = [_state(self.directory, rank) for rank in range(self.ranks)]
            for rank, (pid, rounds, state) in enumerate(states):
                if pid and state == _RUNNING and rank not in told and not _alive(pid):
                    told.add(rank)
                    how = "was killed: its process exited"
                    _tell_the_others(self.store, rank, rounds, how, raised=True)
            waiting = [rank for rank, (_, _, state) in enumerate(states) if state == _WAITING]
            running = [pid for pid, _, state in states if state == _RUNNING and _alive(pid)]
            if self.judging and waiting and not running and not judged:
                judged = True
                self.store.set("verdict", self._verdict(waiting))

    def _verdict(self, waiting):
        """What the ranks waiting for a verdict raise: a rank's error, or the divergence."""
        if self.store.check(["raised"]):
            return _ENDED
        ledger = collective_calls.Ledger(self.ranks, self.calls.buf)
        _, divergence = collective_calls.Judge(ledger).check(final=True)
        if divergence is not None:
            self.verdict = str(collective_calls.divergence_error(divergence))
        else:
            self.verdict = (
                f"{ranks_named(waiting)} wait at collective calls that the other ranks never "
                "make, so they can never meet (on a TPU they would wait forever); calls inside "
                "a torch.compile'd function are not recorded, so their lines are not known "
                "here. Every rank must make the same collective calls in the same order."
            )
        return self.verdict.encode()

    def all_ended(self):
        """Whether every rank that joined has ended, or its process exited."""
        states = [_state(self.directory, rank) for rank in range(self.ranks)]
        return all(state == _ENDED_STATE or not _alive(pid) for pid, _, state in states if pid)

    def close(self):
        """Unlinks the meeting's segments, those that killed ranks left too."""
        self._closed.set()
        self._watch.join()
        self.directory.close()
        self.calls.close()
        for name in os.listdir(_SHM_DIRECTORY):
            if name.startswith(self.prefix):
                _unlink(name)
        del self.store


@contextlib.contextmanager
def meeting(ranks, judging=True):
    """A meeting for ``ranks`` processes, named in ``os.environ`` while it is open."""
    opened = Meeting(ranks, judging)
    try:
        with machine.variable_set(MEETING, opened.address):
            yield opened
    finally:
        opened.close()


class Exchange:
    """A rank's side of the meeting."""

    def __init__(self, rank, ranks, address=None):
        from torch.distributed import TCPStore

        host, port, self.prefix = (address or os.environ[MEETING]).split(":")
        self.rank, self.ranks = rank, ranks
        self.store = TCPStore(host, int(port), None, False, timeout=datetime.timedelta(days=1))
        self.directory = _untracked(self.prefix)
        self._calls = _untracked(f"{self.prefix}-calls")
        # Where this rank writes its collective calls, if the meeting judges them.
        judging = self.store.get("judging") == b"1"
        self.ledger = collective_calls.Ledger(ranks, self._calls.buf) if judging else None
        self.rounds = 0
        self._own = [None, None]  # this rank's two segments
        self._opened = {}  # name -> another rank's segment
        self._write_state(0)

    def join(self):
        """Waits until every rank's process has joined (the first round, with nothing to
        share), as a TPU process's runtime waits at its start for the host's other
        processes. Without it, ``xmp.spawn``'s pool could run a rank that ends at once and
        then another rank's task in the same process, with the first rank's state."""
        self.rounds += 1
        self._meet()

    def _write_segment(self, segment, *values):
        _SEGMENT.pack_into(
            self.directory.buf, _RANK_SIZE * self.rank + _SEGMENT.size * segment, *values
        )

    def _read_segment(self, rank, segment):
        return _SEGMENT.unpack_from(self.directory.buf, _RANK_SIZE * rank + _SEGMENT.size * segment)

    def _write_state(self, state):
        offset = _RANK_SIZE * self.rank + 2 * _SEGMENT.size
        _STATE.pack_into(self.directory.buf, offset, os.getpid(), self.rounds, state)

    def _name(self, rank, segment, generation):
        return f"{self.prefix}-{rank}-{segment}-{generation}"

    def share(self, description, arrays):
        """One round: every rank's description (a str) and its ``arrays`` (numpy arrays of
        bytes), each rank's in a list, in rank order. The arrays read are views of shared
        memory, valid until this rank's next round but one: copy what is kept."""
        self.rounds += 1
        segment = self.rounds % 2
        text = description.encode()
        size = len(text) + sum(array.nbytes for array in arrays)
        own = self._own[segment]
        generation = self._read_segment(self.rank, segment)[0]
        if own is None or own.size < size:
            if own is not None:
                own.close()
                _unlink(own.name)
            generation += 1
            own = _untracked(
                self._name(self.rank, segment, generation), create=True, size=max(size, 4096) * 2
            )
            self._own[segment] = own
        own.buf[: len(text)] = text
        offset = len(text)
        for array in arrays:
            own.buf[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            offset += array.nbytes
        self._write_segment(segment, generation, len(text), size - len(text))
        self._write_state(_RUNNING)
        self._meet()
        descriptions, data = [], []
        for rank in range(self.ranks):
            generation, text_size, data_size = self._read_segment(rank, segment)
            buf = self._segment(rank, segment, generation).buf
            descriptions.append(bytes(buf[:text_size]).decode())
            data.append(np.frombuffer(buf, np.uint8, data_size, text_size))
        return descriptions, data

    def _segment(self, rank, segment, generation):
        if rank == self.rank:
            return self._own[segment]
        name = self._name(rank, segment, generation)
        if name not in self._opened:
            for old in [key for key in self._opened if key.startswith(name.rpartition("-")[0])]:
                with contextlib.suppress(BufferError):
                    self._opened.pop(old).close()
            self._opened[name] = _untracked(name)
        return self._opened[name]

    def _meet(self):
        """Waits until every rank has arrived at this round. A rank that has not arrived and
        has ended (it, or the meeting for a killed one, sets the round's key to say so)
        stops this one with ``RankEnded`` if it raised; if it returned, this rank waits for
        the verdict."""
        key = f"round-{self.rounds}"
        if self.store.add(key, 1) == self.ranks:
            self.store.compare_set(key + "-met", "", b"")
            if self.rounds > 2:
                self.store.delete_key(f"round-{self.rounds - 2}")
                self.store.delete_key(f"round-{self.rounds - 2}-met")
            return
        self.store.wait([key + "-met"])
        if self.store.get(key + "-met") == _ENDED:
            if self.store.check(["raised"]):
                self._raise_the_ended("raised")
            self.await_verdict()

    def await_verdict(self):
        """Waits, as a TPU's rank would wait forever, until the meeting's judge gives its
        verdict (in a launch, the launch's judge stops the rank instead); raises it."""
        self._write_state(_WAITING)
        self.store.wait(["verdict"])
        verdict = self.store.get("verdict")
        if verdict == _ENDED:
            self._raise_the_ended("raised")
        raise CollectiveMismatch(verdict.decode())

    def record(self, steps, name, args, kwargs, frame):
        """A collective call of this rank's, before it runs, for the meeting's judge."""
        self.ledger.record(self.rank, f"step {steps}", name, args, kwargs, frame)

    def _raise_the_ended(self, which="ended"):
        """Raises ``RankEnded`` for the first rank that ended (``which``: or raised)."""
        rank, how = self.store.get(which).decode().split("\0", 1)
        cause = None
        if self.store.check(["ended-cause"]):
            with contextlib.suppress(Exception):
                cause = pickle.loads(self.store.get("ended-cause"))
        raise _ended(int(rank), how, cause)

    def post(self, box, payload):
        """Puts ``payload`` (bytes) last in the mailbox ``box``, which every rank reads."""
        number = self.store.add(f"box-{box}-posted", 1)
        self.store.set(f"box-{box}-{number}", payload)

    def take(self, box, source=None):
        """The first payload in the mailbox ``box`` that no rank has taken (waits for it).
        The wait is hopeless once the rank ``source`` has ended, or, if any rank may send
        (None), once every other rank has; or waits for a verdict, as they do."""
        key = f"box-{box}-{self.store.add(f'box-{box}-taken', 1)}"
        senders = [rank for rank in range(self.ranks) if rank != self.rank]
        if source is not None:
            senders = [source]
        while not self.store.check([key]):
            states = [_state(self.directory, rank)[2] for rank in senders]
            if _RUNNING not in states:
                if self.store.check([key]):  # posted just before it ended
                    break
                if _WAITING in states:
                    self.await_verdict()
                self._raise_the_ended()
            time.sleep(_POLL)
        payload = self.store.get(key)
        self.store.delete_key(key)
        return payload

    def end(self, error):
        """This rank returned (``error`` None) or raised ``error``: the ranks waiting for it
        at a collective, and those that call one later, raise ``RankEnded``. The first rank
        to end stays the cause."""
        if error is None and self.ledger is not None:
            self.ledger.returned(self.rank)
        self._write_state(_ENDED_STATE)
        if isinstance(error, (RankEnded, CollectiveMismatch)):
            return
        how = "returned" if error is None else f"raised {type(error).__name__}: {error}"
        if error is not None:
            with contextlib.suppress(Exception):
                self.store.compare_set("ended-cause", "", pickle.dumps(error))
        _tell_the_others(self.store, self.rank, self.rounds, how, raised=error is not None)

    def close(self):
        self.ledger = None
        for segment in [*self._opened.values(), *filter(None, self._own), self._calls]:
            with contextlib.suppress(BufferError):
                segment.close()
        with contextlib.suppress(BufferError):
            self.directory.close()


def _state(directory, rank):
    """A rank's pid (0 before it joined), rounds so far, and its state (``_RUNNING``,
    ``_ENDED_STATE``, ``_WAITING``)."""
    return _STATE.unpack_from(directory.buf, _RANK_SIZE * rank + 2 * _SEGMENT.size)


def _tell_the_others(store, rank, rounds, how, raised):
    """Rank ``rank`` has ended after ``rounds`` rounds (``raised``: by an error, or killed):
    the first to end, and the first to raise, are named the cause, and the ranks waiting in
    the round it will never reach are woken."""
    first = f"{rank}\0{how}"
    store.compare_set("ended", "", first)
    if raised:
        store.compare_set("raised", "", first)
    store.compare_set(f"round-{rounds + 1}-met", "", _ENDED)


def _ended(rank, how, cause):
    error = RankEnded(f"rank {rank} has ended (it {how})", cause)
    error.rank, error.how = rank, how
    return error


def _alive(pid):
    """False once ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False
