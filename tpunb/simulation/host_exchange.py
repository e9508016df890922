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

A rank that ends says so in the store (``end``) and sets the key of the round it will never
reach: the ranks waiting there stop with ``RankEnded``, naming it (with its exception when
it pickles). For a killed rank the meeting, looking at the processes twice a second, says
it. The launching process unlinks every segment of the meeting as it closes.
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

from tpunb.errors import RankEnded
from tpunb.upstream import registry

MEETING = "TPUNB_SIMULATION_MEETING"  # "host:port:prefix", set by the launching process
# The directory, per rank: for each of its two segments the generation and the lengths of
# the description and data in it; then its pid, its rounds so far and whether it has ended.
_SEGMENT = struct.Struct("<qqq")
_STATE = struct.Struct("<qqq")
_RANK_SIZE = 2 * _SEGMENT.size + _STATE.size
_ENDED = b"ended"  # a round's key set to this: a rank will never arrive
_LOOK_EVERY = 0.5  # seconds between the meeting's looks at the rank processes
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
    """The launching process's side: where ``ranks`` processes meet, for one launch."""

    def __init__(self, ranks):
        from torch.distributed import TCPStore

        self.prefix = f"tpunb-{uuid.uuid4().hex[:12]}"
        self.store = TCPStore(
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(days=1), wait_for_workers=False
        )
        self.directory = _untracked(self.prefix, create=True, size=_RANK_SIZE * ranks)
        self.directory.buf[:] = bytes(self.directory.size)
        self.address = f"127.0.0.1:{self.store.port}:{self.prefix}"
        self.ranks = ranks
        self._closed = threading.Event()
        self._watch = threading.Thread(target=self._watch_the_ranks, daemon=True)
        self._watch.start()

    def _watch_the_ranks(self):
        """A rank process that exits before its rank ended (killed) says nothing: the ranks
        waiting for it are told here, as if it had ended."""
        told = set()
        while not self._closed.wait(_LOOK_EVERY):
            for rank in range(self.ranks):
                pid, rounds, ended = _state(self.directory, rank)
                if pid and not ended and rank not in told and not _alive(pid):
                    told.add(rank)
                    _tell_the_others(self.store, rank, rounds, "was killed: its process exited")

    def all_ended(self):
        """Whether every rank that joined has ended, or its process exited."""
        states = [_state(self.directory, rank) for rank in range(self.ranks)]
        return all(ended or not _alive(pid) for pid, _, ended in states if pid)

    def close(self):
        """Unlinks the meeting's segments, those that killed ranks left too."""
        self._closed.set()
        self._watch.join()
        self.directory.close()
        for name in os.listdir(_SHM_DIRECTORY):
            if name.startswith(self.prefix):
                _unlink(name)
        del self.store


@contextlib.contextmanager
def meeting(ranks):
    """A meeting for ``ranks`` processes, named in ``os.environ`` while it is open."""
    opened = Meeting(ranks)
    before = os.environ.get(MEETING)
    os.environ[MEETING] = opened.address
    try:
        yield opened
    finally:
        if before is None:
            os.environ.pop(MEETING, None)
        else:
            os.environ[MEETING] = before
        opened.close()


class Exchange:
    """A rank's side of the meeting."""

    def __init__(self, rank, ranks, address=None):
        from torch.distributed import TCPStore

        host, port, self.prefix = (address or os.environ[MEETING]).split(":")
        self.rank, self.ranks = rank, ranks
        self.store = TCPStore(host, int(port), None, False, timeout=datetime.timedelta(days=1))
        self.directory = _untracked(self.prefix)
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

    def _write_state(self, ended):
        offset = _RANK_SIZE * self.rank + 2 * _SEGMENT.size
        _STATE.pack_into(self.directory.buf, offset, os.getpid(), self.rounds, ended)

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
        self._write_state(0)
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
        """Waits until every rank has arrived at this round; raises ``RankEnded`` if a rank
        that has not arrived has ended (it, or the meeting for a killed one, sets the round's
        key to say so)."""
        key = f"round-{self.rounds}"
        if self.store.add(key, 1) == self.ranks:
            self.store.compare_set(key + "-met", "", b"")
            if self.rounds > 2:
                self.store.delete_key(f"round-{self.rounds - 2}")
                self.store.delete_key(f"round-{self.rounds - 2}-met")
            return
        self.store.wait([key + "-met"])
        if self.store.get(key + "-met") == _ENDED:
            self._raise_the_ended()

    def _raise_the_ended(self):
        rank, how = self.store.get("ended").decode().split("\0", 1)
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
        (None), once every other rank has."""
        key = f"box-{box}-{self.store.add(f'box-{box}-taken', 1)}"
        senders = [rank for rank in range(self.ranks) if rank != self.rank]
        if source is not None:
            senders = [source]
        while not self.store.check([key]):
            if all(_state(self.directory, rank)[2] for rank in senders):
                if self.store.check([key]):  # posted just before it ended
                    break
                self._raise_the_ended()
            time.sleep(_POLL)
        payload = self.store.get(key)
        self.store.delete_key(key)
        return payload

    def end(self, error):
        """This rank returned (``error`` None) or raised ``error``: the ranks waiting for it
        at a collective, and those that call one later, raise ``RankEnded``. The first rank
        to end stays the cause."""
        self._write_state(1)
        if isinstance(error, RankEnded):
            return
        how = "returned" if error is None else f"raised {type(error).__name__}: {error}"
        if error is not None:
            with contextlib.suppress(Exception):
                self.store.compare_set("ended-cause", "", pickle.dumps(error))
        _tell_the_others(self.store, self.rank, self.rounds, how)

    def close(self):
        for segment in [*self._opened.values(), *filter(None, self._own)]:
            with contextlib.suppress(BufferError):
                segment.close()
        with contextlib.suppress(BufferError):
            self.directory.close()


def _state(directory, rank):
    """A rank's pid (0 before it joined), rounds so far, and whether it has ended."""
    return _STATE.unpack_from(directory.buf, _RANK_SIZE * rank + 2 * _SEGMENT.size)


def _tell_the_others(store, rank, rounds, how):
    """Rank ``rank`` has ended after ``rounds`` rounds: the first to end is named the cause,
    and the ranks waiting in the round it will never reach are woken."""
    first = f"{rank}\0{how}"
    store.compare_set("ended", "", first)
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
