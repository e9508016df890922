"""The one judge of ranks that take different paths to their collectives.

Ranks that make different collective calls can never meet: on a TPU they wait for each
other forever (or a rank's call meets another's later one, and the wait comes later,
somewhere else). What "the same call" means is defined here once (``identity``: the
collective's name, its tensors' dtypes and shapes, its other arguments), and judged here
once (``Judge``), wherever the ranks run:

- in a launch, on a TPU as on simulated cores: the notebook's supervisor judges the launch's
  ``Ledger`` as the ranks fill it, and stops the launch with ``divergence_error``;
- on simulated cores with no launch around them (a plain ``xmp.spawn``, ``python -m
  tpunb.simulate``, pytest): the simulation's meeting judges its own ``Ledger`` once no
  rank is running any more, and the waiting ranks raise its verdict (host_exchange.py).

For the duration of either, torch_xla's collectives (``xm.all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``collective_permute``, ``collective_broadcast``, and what
calls them: ``xm.optimizer_step``, ``xm.rendezvous``, ``xm.mesh_reduce``, torch.distributed's
XLA backend) are wrapped (``recording``): each outermost call is written, before it runs, to
memory shared by the ranks and their judge (its words, its identity, the program's file and
line, the rank's batch or step). Point-to-point ``xm.send``/``xm.recv``, and
``collective_permute`` among some ranks (what torch.distributed's ``send`` and ``recv``
lower to), are not recorded: two ranks make different calls there by design. Calls inside a
``torch.compile``d function are not either: dynamo traces them, once.

The judge compares the ranks' calls position by position: other calls at the same position
are a divergence, and so is a call that ranks which have returned will never make; the same
call from other lines is warned about once (the ranks may be pairing calls that do not
belong together).
"""

import contextlib
import hashlib
import mmap
import struct
import sys
import threading
import time
import typing

from tpunb import program_lines
from tpunb.errors import RankError
from tpunb.reports import ranks_named
from tpunb.upstream import registry

# The collectives of torch_xla.core.xla_model that are recorded: what every other one calls.
RECORDED = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "collective_broadcast",
)
RING = 256  # the calls kept for each rank: the judge reads them 10 times a second
_ENTRY = 512  # bytes a call: identity, where's identity, text length, text
_HEADER = struct.Struct("<qq")  # calls made, returned (1) or not (0)
_CALL = struct.Struct("<qqq")
_TEXT = _ENTRY - _CALL.size
# In a launch, how long a rank that made a call the returned ranks will never make may
# still be running before the judge says so: the ranks still running get the time to
# return, so that the report groups them (ranks waiting at a TPU's collective never end).
ENDED_GRACE = 2.0
_inside = threading.local()  # depth of recorded collectives in this thread


def describe(name, args, kwargs, shown=None):
    """``name(float32[4, 2], 'sum', groups=[[0, 1]])``: its tensors' dtypes and shapes and
    its other arguments; of a list of tensors the first ``shown`` (all if None)."""
    parts = [_value(arg, shown) for arg in args]
    parts += [f"{key}={_value(value, shown)}" for key, value in sorted(kwargs.items())]
    return f"{name.lstrip('_').replace('xla_', '', 1)}({', '.join(parts)})"


def identity(name, args, kwargs):
    """What makes two ranks' collective calls the same call: its name, every tensor's dtype
    and shape, its other arguments (all in words, so that it compares between processes)."""
    return describe(name, args, kwargs)


def where(frame, name=None):
    """Where the program made the call of collective ``name`` that reached ``frame``: "cell
    In[3], line 5 (through torch_xla's save)", or "inside torch_xla"."""
    program, entry = program_lines.program_frame(frame, program_lines.libraries())
    words = "inside torch_xla"
    if program is not None:
        words = f"{program_lines.cell_or_file(program.f_code.co_filename)}, line {program.f_lineno}"
    return words + (f" (through torch_xla's {entry})" if entry and entry != name else "")


def among_some(pairs, world_size):
    """Whether a ``collective_permute`` with ``pairs`` leaves out some of the ``world_size``
    ranks: then only the ranks its pairs name make the call, each pair its own (what
    torch.distributed's ``send`` and ``recv`` lower to on the XLA backend)."""
    return {rank for pair in pairs for rank in pair} != set(range(world_size))


def _digest(text):
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def _value(value, shown=None):
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        values = list(value)
        if shown is not None and len(values) > shown:
            first = ", ".join(_value(v) for v in values[:shown])
            return f"{len(values)} tensors: [{first}, ...]"
        return "[" + ", ".join(_value(v) for v in values) + "]"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return repr(list(value))
    return type(value).__name__


class Call(typing.NamedTuple):
    key: int  # the call's identity, digested
    where_key: int
    call: str  # in words: all_reduce('sum', float32[10])
    where: str  # cell In[3], line 5 (through torch_xla's save)
    when: str  # batch 3 (of the training loader's epoch), or step 3 (the rank's syncs)


class Ledger:
    """Each rank's calls in memory shared with the ranks: written by the ranks, read by the
    judge. ``memory``: a writable buffer of ``Ledger.size(ranks)`` bytes that the ranks
    share (the simulation's meeting gives a named one, for spawned ranks too); by default
    an anonymous mapping made before the fork."""

    def __init__(self, ranks, memory=None):
        self.ranks = ranks
        self._size = _HEADER.size + RING * _ENTRY
        self._own = memory is None
        self._memory = mmap.mmap(-1, self.size(ranks)) if memory is None else memory

    @staticmethod
    def size(ranks):
        return (_HEADER.size + RING * _ENTRY) * ranks

    def record(self, rank, when, name, args, kwargs, frame):
        """In a rank, before its collective runs; ``when``: "batch 3" or "step 3"."""
        place = where(frame, name)
        # In words, the arguments a program chose: not the layout pinning, nor Nones.
        chosen = {k: v for k, v in kwargs.items() if v is not None and k != "pin_layout"}
        words = describe(name, args, chosen, shown=3)
        text = f"{words}\0{place}\0{when}".encode()[:_TEXT]
        key = _digest(identity(name, args, kwargs))
        base = self._size * rank
        made, returned = _HEADER.unpack_from(self._memory, base)
        offset = base + _HEADER.size + (made % RING) * _ENTRY
        _CALL.pack_into(self._memory, offset, key, _digest(place), len(text))
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
        words, place, when = (text.decode(errors="replace").split("\0") + ["", ""])[:3]
        return Call(key, where_key, words, place, when)

    def close(self):
        if self._own:
            self._memory.close()


class Divergence(typing.NamedTuple):
    """Ranks that can never meet: at collective call number ``position`` (from 1), groups
    of ranks and the call each made there."""

    position: int
    groups: list  # [(ranks, the Call they made there, or what they did instead)]
    parted: "Divergence | None"  # an earlier position where the lines differed


class Judge:
    """The ranks' calls in a ``Ledger``, compared as they are made."""

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
            lines.append(f"  {ranks_named(ranks)}: {_calls(count)}, the last {last}")
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


def lines(divergence):
    """Each group's call at the divergence's position, a line each."""
    return "\n".join(
        f"  {ranks_named(ranks)}: "
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


def divergence_error(divergence):
    """The error that names a divergence: which ranks made which call where, what to change."""
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


@contextlib.contextmanager
def recorded(on_call):
    """For the duration: every outermost call of a ``RECORDED`` collective, outside a
    ``torch.compile``d function, calls ``on_call(name, args, kwargs, frame)`` in the
    calling thread before it runs (``frame``: its caller's)."""
    with registry.during("collective_ledger", on_call):
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
    return among_some(pairs, xr.world_size())
