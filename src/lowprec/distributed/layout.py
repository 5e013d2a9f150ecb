"""Where a DDP bucket's values go: columns, stripes, and the per-bucket state of ``onebit_hook``.

**Columns.** A DDP bucket is a flat concatenation of parameter gradients. Each parameter is cut
into columns (the unit that shares two floats): a weight with two or more dimensions, in PyTorch's
``[out, in, ...]`` layout, gives one column per output unit, ``w[i]`` (``w[i].numel()`` values,
contiguous), as long as that is at least ``min_column_size`` values; every other parameter (biases,
norms, scalars, weights with tiny output units) is cut into ``ceil(numel / column_size)`` columns of
consecutive values, as equal in length as possible. So a column never spans two parameters, and
the columns of a parameter do not depend on which bucket it sits in.

**Stripes.** For a group of ``W`` ranks a bucket's columns are cut into ``W`` stripes of about
equal size (cuts fall between columns); rank ``r`` aggregates stripe ``r``. A stripe is a list of
*blocks*, runs of equal-length columns that the kernels take as one ``[columns, length]`` tensor:
adjacent parameters with columns of one length (a stack of equal layers) share a block, so a kernel
call covers as many values as possible.

**Messages.** Each rank's message for a stripe (a *chunk*) is ``[2 FP32 stats per column | codes
packed 8 // bits per byte | padding | 1 flag byte]``, padded to the largest stripe's size and
rounded up to a multiple of 4, so that every chunk of a ``[W, S]`` byte buffer starts with aligned
FP32 stats.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from lowprec.distributed.quantize import packed_size

__all__ = ["column_runs"]


def column_runs(
    shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...],
    *,
    column_size: int = 1024,
    min_column_size: int = 32,
) -> list[tuple[int, int, int]]:
    """The columns of tensors of ``shapes`` laid end to end, as runs of equal-length columns.

    Args:
        shapes: Parameter shapes, in bucket order.
        column_size: Longest column cut from a flat parameter (default: 1024).
        min_column_size: Shortest output unit that is a column of its own (default: 32).

    Returns:
        ``(start, columns, length)`` triples: ``columns`` columns of ``length`` values each,
        starting at flat offset ``start``; together they cover every value once, in order.
    """
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        if numel == 0:
            continue
        if len(shape) >= 2 and numel // shape[0] >= min_column_size:
            runs.append((offset, shape[0], numel // shape[0]))  # one column per output unit
        else:
            ncols = -(-numel // column_size)
            short, extra = divmod(numel, ncols)  # `extra` columns of short + 1, the rest of short
            if extra:
                runs.append((offset, extra, short + 1))
            runs.append((offset + extra * (short + 1), ncols - extra, short))
        offset += numel
    return runs


@dataclass(frozen=True)
class _Block:
    """``ncols`` columns of ``length`` values, contiguous, inside a stripe."""

    start: int  # first value, counted from the stripe's start
    ncols: int
    length: int
    col: int  # first column, counted from the stripe's first column


@dataclass(frozen=True)
class _Stripe:
    start: int  # first value in the bucket
    end: int
    ncols: int
    blocks: tuple[_Block, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


class _Layout:
    """One bucket's parameters, columns, stripes and chunk size, and this rank's residuals for it.

    ``local`` is this rank's residual for the whole bucket; ``stripe_residual`` the residual of
    the stripe this rank aggregates (``stripes[rank]``). Both are FP32, on the bucket's device.
    """

    def __init__(
        self,
        keys: tuple[str, ...],
        shapes: list[tuple[int, ...]],
        *,
        world_size: int,
        rank: int,
        bits: int,
        column_size: int,
        min_column_size: int,
    ) -> None:
        self.keys = keys
        self.rank = rank
        self.numels = [math.prod(s) for s in shapes]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.index = {k: i for i, k in enumerate(keys)}
        runs = column_runs(shapes, column_size=column_size, min_column_size=min_column_size)
        bounds = [0]
        for r in range(1, world_size):
            target = r * self.numel // world_size
            bounds.append(max(bounds[-1], _nearest_column_boundary(runs, target)))
        bounds.append(self.numel)
        self.stripes = [_stripe(runs, a, b) for a, b in itertools.pairwise(bounds)]
        max_cols = max(s.ncols for s in self.stripes)
        max_vals = max(s.numel for s in self.stripes)
        # Chunk: [stats: 2 FP32 per column][packed codes][pad][flag byte]. The size is a multiple
        # of 4 so that every chunk of a [W, S] uint8 buffer can be viewed as FP32 at its start.
        self.codes_at = 8 * max_cols
        self.chunk_bytes = -(-(self.codes_at + packed_size(max_vals, bits) + 1) // 4) * 4
        self.local = torch.empty(0)
        self.stripe_residual = torch.empty(0)
        # Scratch for unpacked codes, made at the first compressed step ("meta": not yet).
        self.codes = torch.empty(0, device="meta")
        self.all_codes = torch.empty(0, device="meta")

    def span(self, key: str) -> tuple[int, int]:
        i = self.index[key]
        return self.offsets[i], self.offsets[i + 1]

    def own_piece(self, key: str) -> tuple[int, torch.Tensor] | None:
        """This rank's stripe residual for ``key``: (first value within the parameter, values)."""
        lo, hi = self.span(key)
        own = self.stripes[self.rank]
        a, b = max(lo, own.start), min(hi, own.end)
        if a >= b:
            return None
        return a - lo, self.stripe_residual[a - own.start : b - own.start]


def _nearest_column_boundary(runs: list[tuple[int, int, int]], target: int) -> int:
    for start, ncols, length in runs:
        if start <= target < start + ncols * length:
            return start + (target - start + length // 2) // length * length
    return target


def _stripe(runs: list[tuple[int, int, int]], a: int, b: int) -> _Stripe:
    blocks: list[_Block] = []
    col = 0
    for start, ncols, length in runs:
        lo, hi = max(a, start), min(b, start + ncols * length)
        if lo < hi:  # stripe bounds fall between columns, so (hi - lo) is whole columns
            n = (hi - lo) // length
            last = blocks[-1] if blocks else None
            if last is not None and last.length == length:  # runs are contiguous: extend
                blocks[-1] = _Block(last.start, last.ncols + n, length, last.col)
            else:
                blocks.append(_Block(lo - a, n, length, col))
            col += n
    return _Stripe(a, b, col, tuple(blocks))
