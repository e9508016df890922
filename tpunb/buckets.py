"""Fixed shapes for variable-length data: pad each batch of sequences to the smallest of a
few bucket lengths (so XLA compiles a few graphs, not one a length), and optionally pad a
short last batch to the full batch size."""

from __future__ import annotations

import bisect
import random
from typing import TYPE_CHECKING

from tpunb.errors import TpunbError, check_count

if TYPE_CHECKING:
    from collections.abc import Iterable


def choose_buckets(
    lengths: Iterable[int], count: int = 4, batch_size: int | None = None
) -> list[int]:
    """``count`` bucket lengths from the data's sequence lengths: quantiles, so that about
    as many batches fall in each bucket, the last one the longest length. A batch is
    padded to its longest sequence, so with ``batch_size`` the quantiles are those of the
    longest length in shuffled batches of that size (a fixed shuffle: the same buckets
    every call). Padding costs compute; each bucket costs a compilation.

    Args:
        lengths: each sample's sequence length.
        count: how many bucket lengths.
        batch_size: the per-core batch size the loader will use, or None.

    Returns:
        The bucket lengths, ascending; give them to ``BucketCollate``."""
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise TpunbError("choose_buckets(lengths) needs the dataset's sequence lengths.")
    check_count(count, "choose_buckets(lengths, count=...)", "buckets", 4)
    if batch_size:
        shuffled = random.Random(0).sample(lengths, len(lengths))
        lengths = [max(shuffled[i : i + batch_size]) for i in range(0, len(lengths), batch_size)]
    lengths.sort()
    picks = {
        lengths[min(len(lengths) - 1, -(-len(lengths) * i // count) - 1)]
        for i in range(1, count + 1)
    }
    return sorted(picks)


class BucketCollate:
    """A DataLoader ``collate_fn`` for samples ``(sequence, *rest)``, a sequence being a
    tensor whose first dimension is its length. Returns ``(padded, *rest, lengths)``:
    the sequences padded with ``pad_value`` to the smallest bucket that fits the longest,
    the rest stacked as the default collate does, and each sequence's true length (0 for
    rows added to reach ``batch_size``). With ``batch_size``, a short batch is padded to
    that many rows, so the last batch of an epoch has the usual shape too: mask the loss
    with ``lengths > 0``.

        loader = DataLoader(data, batch_size=32,
                            collate_fn=tpunb.BucketCollate([16, 32, 48, 64], batch_size=32))
    """

    def __init__(
        self, buckets: Iterable[int], pad_value: float = 0, batch_size: int | None = None
    ) -> None:
        buckets = sorted({int(b) for b in buckets})
        if not buckets or buckets[0] < 1:
            raise TpunbError(
                f"BucketCollate(buckets={buckets!r}): give positive lengths, e.g. [16, 32, 64], "
                "or tpunb.choose_buckets(lengths, 4) to pick them from the data."
            )
        self.buckets = buckets
        self.pad_value = pad_value
        self.batch_size = batch_size

    def __call__(self, samples):
        import torch
        from torch.utils.data import default_collate

        sequences = [
            sample[0] if isinstance(sample, (tuple, list)) else sample for sample in samples
        ]
        rest = [tuple(sample[1:]) for sample in samples if isinstance(sample, (tuple, list))]
        longest = max(len(s) for s in sequences)
        index = bisect.bisect_left(self.buckets, longest)
        if index == len(self.buckets):
            raise TpunbError(
                f"A sequence of length {longest} is longer than the largest bucket "
                f"({self.buckets[-1]}). Add a bucket of at least {longest}, or truncate the "
                "sequences to the largest bucket first."
            )
        rows = len(sequences)
        if self.batch_size is not None:
            if rows > self.batch_size:
                raise TpunbError(
                    f"BucketCollate(batch_size={self.batch_size}) got a batch of {rows}: give "
                    "it the DataLoader's batch size."
                )
            rows = self.batch_size
        first = sequences[0]
        padded = first.new_full((rows, self.buckets[index], *first.shape[1:]), self.pad_value)
        lengths = torch.zeros(rows, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            padded[row, : len(sequence)] = sequence
            lengths[row] = len(sequence)
        if not rest or not rest[0]:
            return padded, lengths
        stacked = default_collate(rest)
        if rows > len(sequences):
            stacked = [_pad_rows(column, rows) for column in stacked]
        return (padded, *stacked, lengths)


def _pad_rows(column, rows):
    padding = column.new_zeros((rows - len(column), *column.shape[1:]))
    import torch

    return torch.cat([column, padding])
