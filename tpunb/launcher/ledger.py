"""Every rank's collective calls, in the order it makes them, where the notebook sees them
as they are made: so a launch whose ranks took different paths is stopped at once, naming
each rank's call and line, on a TPU as on simulated cores.

Ranks that make different collective calls can never meet: on a TPU they wait for each
other forever (or a rank's call meets another's later one, and the wait comes later,
somewhere else). For the duration of a launch, torch_xla's collectives (``xm.all_reduce``,
``all_gather``, ``reduce_scatter``, ``all_to_all``, ``collective_permute``,
``collective_broadcast``, and what calls them: ``xm.optimizer_step``, ``xm.rendezvous``,
``xm.mesh_reduce``, torch.distributed's XLA backend) are wrapped: each outermost call is
written, before it runs, to memory shared with the notebook (its words, a key that tells
calls apart, the program's file and line, the rank's batch or step).
Point-to-point ``xm.send``/``xm.recv``, and ``collective_permute`` among some ranks (what
torch.distributed's ``send`` and ``recv`` lower to), are not recorded: two ranks make
different calls there by design. Calls inside a ``torch.compile``d function are not
either: dynamo traces them, once.

In the notebook, ``Watch.check`` compares the ranks' calls position by position: other
calls at the same position (kind, shapes, dtypes, groups) are a divergence, and so is a
call that ranks which have returned will never make; the same call from other lines is
warned about once (the ranks may be pairing calls that do not belong together).
"""

import contextlib
import mmap
import struct
import sys
import threading
import time
import typing

from tpunb.errors import RankError
from tpunb.launcher.failures import span
from tpunb.upstream import registry
from tpunb.watch import collective_calls
from tpunb.wording import program_lines

# The collectives of torch_xla.core.xla_model that are recorded: what every other one calls.
RECORDED = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)
RING = 256  # the calls kept for each rank: the notebook reads them 10 times a second
_ENTRY = 512  # bytes a call: key, where's key, text length, text
_HEADER = struct.Struct("<qq")  # calls made, returned (1) or not (0)
_CALL = struct.Struct("<qqq")
_TEXT = _ENTRY - _CALL.size
# How long a rank that made a call the returned ranks will never make may still be
# running before that is a divergence (lazy collectives run at the rank's next sync).
ENDED_GRACE = 2.0
_inside = threading.local()  # depth of recorded collectives in this thread


class Call(typing.NamedTuple):
    key: int
    where_key: int
    call: str  # in words: all_reduce('sum', float32[10])
    where: str  # cell In[3], line 5 (through torch_xla's save)
    when: str  # batch 3 (of the training loader's epoch), or step 3 (the rank's syncs)


class Ledger:
    """Each rank's calls in memory shared with the forked ranks (an anonymous mapping made
    before the fork: no file descriptor), written by the ranks, read by the notebook."""

    def __init__(self, ranks):
        self.ranks = ranks
        self._size = _HEADER.size + RING * _ENTRY
        self._memory = mmap.mmap(-1, self._size * ranks)
        self._libraries = None

    def record(self, rank, when, name, args, kwargs, frame):
        """In a rank, before its collective runs; ``when``: "batch 3" or "step 3"."""
        if self._libraries is None:
            self._libraries = program_lines.libraries()
        program, entry = program_lines.program_frame(frame, self._libraries)
        if program is None:
            where, line = "inside torch_xla", 0
        else:
            where = program_lines.cell_or_file(program.f_code.co_filename)
            line = program.f_lineno
            where += f", line {line}"
        if entry and entry != name:
            where += f" (through torch_xla's {entry})"
        # In words, the arguments a program chose: not the layout pinning, nor Nones.
        chosen = {k: v for k, v in kwargs.items() if v is not None and k != "pin_layout"}
        words = collective_calls.describe(name, args, chosen, shown=3)
        text = f"{words}\0{where}\0{when}".encode()[:_TEXT]
        key = collective_calls.key(name, args, kwargs)
        base = self._size * rank
        made, returned = _HEADER.unpack_from(self._memory, base)
        offset = base + _HEADER.size + (made % RING) * _ENTRY
        _CALL.pack_into(self._memory, offset, key, hash(where), len(text))
        self._memory[offset + _CALL.size : offset + _CALL.size + len(text)] = text
        _HEADER.pack_into(self._memory, base, made + 1, returned)  # the call, then its count

    def returned(self, rank):
        """In a rank, once its function returned: it makes no more calls."""
        base = self._size * rank
        made, _ = _HEADER.unpack_from(self._memory, base)
        _HEADER.pack_into(self._memory, base, made, 1)

    def made(self, rank):
        """(calls rank has made, whether it has returned)."""
        made, returned = _HEADER.unpack_from(self._memory, self._size * rank)
        return made, bool(returned)

    def call(self, rank, position):
        """The rank's call at ``position`` (from 0), or None once the ring has dropped it."""
        made, _ = self.made(rank)
        if not made - RING < position < made:
            return None
        offset = self._size * rank + _HEADER.size + (position % RING) * _ENTRY
        key, where_key, size = _CALL.unpack_from(self._memory, offset)
        text = bytes(self._memory[offset + _CALL.size : offset + _CALL.size + size])
        if self.made(rank)[0] - RING >= position:  # overwritten while read
            return None
        words, where, when = (text.decode(errors="replace").split("\0") + ["", ""])[:3]
        return Call(key, where_key, words, where, when)

    def close(self):
        self._memory.close()


class Divergence(typing.NamedTuple):
    """Ranks that can never meet: at collective call number ``position`` (from 1), groups
    of ranks and the call each made there."""

    position: int
    groups: list  # [(ranks, the Call they made there, or what they did instead)]
    parted: "Divergence | None"  # an earlier position where the lines differed


class Watch:
    """In the notebook: the ranks' calls compared as they are made."""

    def __init__(self, ledger):
        self.ledger = ledger
        self._compared = 0  # positions before this one: every rank's call compared
        self.parted = None  # the first position where the ranks' lines differed
        self._unmatched_since = None

    def check(self, final=False):
        """(warnings, a ``Divergence`` or None). ``final``: the ranks are stopped; a call
        the returned ranks never made is a divergence at once."""
        ledger, warnings = self.ledger, []
        made = [ledger.made(rank) for rank in range(ledger.ranks)]
        common = min(count for count, _ in made)
        for position in range(self._compared, common):
            calls = [ledger.call(rank, position) for rank in range(ledger.ranks)]
            if None in calls:
                continue  # dropped from a rank's ring before it was read
            if len({call.key for call in calls}) > 1:
                self._compared = position
                return warnings, Divergence(position + 1, _groups(calls), self.parted)
            if self.parted is None and len({call.where_key for call in calls}) > 1:
                self.parted = Divergence(position + 1, _groups(calls), None)
                warnings.append(parted_warning(self.parted))
        self._compared = max(self._compared, common)
        return warnings, self._unmatched(made, final)

    def _unmatched(self, made, final):
        """Ranks still running that made a call which a returned rank will never make."""
        returned = [count for count, done in made if done]
        fewest = min(returned, default=None)
        if fewest is None or all(done or count <= fewest for count, done in made):
            self._unmatched_since = None
            return None
        self._unmatched_since = self._unmatched_since or time.monotonic()
        if not final and time.monotonic() - self._unmatched_since < ENDED_GRACE:
            return None
        calls = []
        for rank, (count, done) in enumerate(made):
            if count > fewest:
                calls.append(self.ledger.call(rank, fewest) or "made it (no longer kept)")
            elif done:
                calls.append(f"made none: returned after {_calls(count)}")
            else:
                calls.append(f"has not made it: {_calls(count)} so far")
        return Divergence(fewest + 1, _groups(calls), self.parted)

    def behind(self, running):
        """In words, for a hang report: which of the ``running`` ranks made more collective
        calls than the others, and the last call of each; None where all made as many."""
        made = {rank: self.ledger.made(rank)[0] for rank in running}
        if len(set(made.values())) < 2:
            return None
        lines = []
        for count in sorted(set(made.values()), reverse=True):
            ranks = [rank for rank in running if made[rank] == count]
            call = self.ledger.call(ranks[0], count - 1) if count else None
            last = f"{call.call} at {call.where}, in {call.when}" if call else "none"
            lines.append(f"  {_ranks(ranks)}: {_calls(count)}, the last {last}")
        return "\n".join(lines)


def _groups(calls):
    """[(ranks, call)] of ranks that made the same call at the same line (or, for ranks
    that made none there, the same words), in rank order."""
    groups = {}
    for rank, call in enumerate(calls):
        same = (call.key, call.where_key) if isinstance(call, Call) else call
        groups.setdefault(same, ([], call))[0].append(rank)
    return sorted(groups.values(), key=lambda group: group[0][0])


def _calls(count):
    return f"{count} collective call{'s' if count != 1 else ''}"


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {span(ranks)}"


def lines(divergence):
    """Each group's call at the divergence's position, a line each."""
    return "\n".join(
        f"  {_ranks(ranks)}: "
        + (f"{call.call} at {call.where}, in {call.when}" if isinstance(call, Call) else call)
        for ranks, call in divergence.groups
    )


def parted_warning(parted):
    return (
        f"The ranks made their collective call number {parted.position} from different "
        f"lines:\n{lines(parted)}\nEach rank's call meets the others' call at the same "
        "position, whatever its line: if one of these calls is under an `if` on the rank "
        "(or a rank makes more calls in a loop), the ranks are pairing calls that do not "
        "belong together, and will wait for each other at the end. Make every rank take "
        "the same path to its collectives."
    )


@contextlib.contextmanager
def recorded(on_call):
    """For the duration: every outermost call of a ``RECORDED`` collective, outside a
    ``torch.compile``d function, calls ``on_call(name, args, kwargs, frame)`` in the
    calling thread before it runs (``frame``: its caller's)."""
    with registry.during("launch_ledger", on_call):
        yield


def recording(name, collective, on_call):
    """The registry's maker: ``xm.<name>`` calling ``on_call`` first, as ``recorded`` says."""
    import torch

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo traces the collective alone
            return collective(*args, **kwargs)
        if getattr(_inside, "depth", 0) == 0 and not _point_to_point(name, args, kwargs):
            on_call(name, args, kwargs, sys._getframe(1))
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return collective(*args, **kwargs)
        finally:
            _inside.depth -= 1

    call.__name__ = call.__qualname__ = name
    call.__doc__ = collective.__doc__
    call.__wrapped__ = collective
    return call


def _point_to_point(name, args, kwargs):
    """A ``collective_permute`` whose pairs leave out some rank: torch.distributed's
    ``send`` and ``recv`` (one pair each), which only the pair's two ranks make, each a
    different one."""
    if name != "collective_permute":
        return False
    import torch_xla.runtime as xr

    pairs = kwargs.get("pairs", args[1] if len(args) > 1 else ())
    return collective_calls.among_some(pairs, xr.world_size())


def divergence_error(divergence):
    """The launch's error: which ranks made which call where, and what to change."""
    message = (
        "The ranks took different paths: at their collective call number "
        f"{divergence.position} they made different calls, so they can never meet (on a "
        f"TPU they would wait for each other forever):\n{lines(divergence)}"
    )
    if divergence.parted is not None:
        message += (
            f"\nTheir paths parted earlier, at call number {divergence.parted.position}, made "
            f"from different lines:\n{lines(divergence.parted)}"
        )
    message += (
        "\nEvery rank must make the same collective calls in the same order. A collective "
        "under `if rank == 0` (xm.all_reduce, xm.rendezvous, xm.mesh_reduce there) runs on "
        "that rank only: make it on every rank, and keep only the print under the `if`. "
        "A rank with more batches or a last batch of another size: a DistributedSampler "
        "(tpunb.shard) and drop_last=True on the DataLoader."
    )
    odd = [ranks for ranks, _ in divergence.groups]
    odd = [rank for ranks in odd if len(ranks) < max(map(len, odd)) for rank in ranks]
    every = [rank for ranks, _ in divergence.groups for rank in ranks]
    return RankError(message, ranks=odd or every)
