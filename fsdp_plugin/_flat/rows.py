"""The row-aligned flat layout: where each parameter sits in its unit's flat buffer.

Rule: parameters keep their registration order, contiguous, in a buffer of ``padded = n * chunk`` elements;
shard rank ``r`` keeps ``[r*chunk, (r+1)*chunk)``. Every chunk boundary that falls strictly inside a
parameter falls on one of its *row* boundaries (a row is ``shape[1:]``: one matrix row, one expert of a 3-D
stack; 0-d and 1-D parameters have rows of one element). So every rank's piece of a parameter is whole
rows, and its local tensor is ``(k, *shape[1:])``: the full shape where it lies whole on the rank, ``k = 0``
where the rank holds none of it.

How: a parameter cut by a boundary is moved forward by a gap of fewer than one of its rows; a parameter
spanning two or more boundaries also needs ``chunk`` to be a multiple of its row size. Padding is the gaps
(< one row per cut parameter, at most ``n - 1`` cuts) plus the rounding of ``chunk``. The engine and
``fp.plan`` both use :func:`row_aligned_offsets`, so the planner's byte model sees the same padding.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence


def row_numel(shape: Sequence[int]) -> int:
    """Elements per row: ``prod(shape[1:])`` for 2-D and up, 1 for 0-d and 1-D shapes."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def local_shape(shape: Sequence[int], lo: int, hi: int) -> tuple:
    """Shape of the piece ``[lo, hi)`` (whole rows) of a flattened parameter of ``shape``."""
    numel = math.prod(shape)
    if (lo, hi) == (0, numel):
        return tuple(shape)
    return ((hi - lo) // row_numel(shape), *tuple(shape)[1:])


def row_aligned_offsets(shapes: Sequence[Sequence[int]], n: int) -> tuple[list[int], int]:
    """``(offsets, padded)``: each parameter's first element in the flat buffer and the buffer's length
    (a multiple of ``n``), following the module rule. Deterministic: every rank computes the same."""
    numels = [math.prod(s) for s in shapes]
    widths = [row_numel(s) for s in shapes]
    total = sum(numels)
    if total == 0:
        return [0] * len(shapes), 0
    step, chunk = 1, -(-total // n)
    while True:
        chunk = -(-chunk // step) * step
        offsets, end, need = _place(numels, widths, chunk)
        if need is not None:
            step = math.lcm(step, need)
        elif end <= n * chunk:
            return offsets, n * chunk
        else:
            chunk = -(-end // n)


def _place(numels: list[int], widths: list[int], chunk: int) -> tuple[list[int], int, Optional[int]]:
    """Offsets for a given ``chunk``; the third item is a row size ``chunk`` must be a multiple of (else None)."""
    offsets, o = [], 0
    for numel, w in zip(numels, widths):
        if numel and w > 1:
            boundary = (o // chunk + 1) * chunk
            if boundary < o + numel and (boundary - o) % w:
                o += (boundary - o) % w            # the gap: fewer than one row
            boundary = (o // chunk + 1) * chunk    # after the gap: the first boundary inside, if any
            if boundary < o + numel and ((boundary - o) % w or (boundary + chunk < o + numel and chunk % w)):
                return offsets, o, w
        offsets.append(o)
        o += numel
    return offsets, o, None


def piece(offset: int, numel: int, chunk: int, j: int) -> tuple[int, int]:
    """Shard rank ``j``'s piece ``[lo, hi)`` of the flattened parameter at ``offset`` (``lo == hi``: none)."""
    lo = min(max(j * chunk - offset, 0), numel)
    hi = min(max((j + 1) * chunk - offset, 0), numel)
    return lo, max(lo, hi)
