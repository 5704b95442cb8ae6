"""Pieces as boxes of the global tensor (manifest version 2) and the runs that move their bytes.

A stored piece is either a flat element range ``[rank, start, stop]`` of the row-major flattened tensor
(version 1, still written for every piece that is one: any model without tensor parallelism), or a box
``[rank, [offset, ...], [size, ...]]`` of the global tensor (a tensor-parallel box, or our rows of one), its
elements stored contiguously in the box's own row-major order. Both are lists of *runs*: ``(global_start,
length)`` of the flattened tensor, ascending, in storage order; reading intersects the runs of a stored piece
with those of the local destination (:func:`overlaps`), so any (dp, tp) layout loads any other without
placement algebra. Runs merge the trailing dimensions a box spans whole: a colwise (row-split) box is one run,
a rowwise (column-split) one is one run per row.
"""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence


def is_box(piece) -> bool:
    """``[rank, offsets, sizes]`` (True) or ``[rank, start, stop]`` (False)."""
    return isinstance(piece[1], list)


def piece_numel(piece) -> int:
    return math.prod(piece[2]) if is_box(piece) else piece[2] - piece[1]


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        out[d], acc = acc, acc * shape[d]
    return out


def piece_start(piece, shape: Sequence[int]) -> int:
    """Flat index of the piece's first element (the sort key of a tensor's pieces)."""
    if not is_box(piece):
        return piece[1]
    return sum(o * s for o, s in zip(piece[1], _strides(shape)))


def box_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The box's elements as ascending runs ``(global_start, length)`` of the flattened tensor."""
    nd = len(shape)
    if nd == 0:
        return [(0, 1)]
    if any(s == 0 for s in sizes):
        return []
    strides = _strides(shape)
    j = nd - 1
    while j > 0 and sizes[j] == shape[j]:
        j -= 1
    length = sizes[j] * strides[j]
    base = offsets[j] * strides[j] + sum(offsets[d] * strides[d] for d in range(j + 1, nd))
    outer = [range(offsets[d], offsets[d] + sizes[d]) for d in range(j)]
    return [(base + sum(i * strides[d] for d, i in enumerate(idx)), length) for idx in itertools.product(*outer)]


def piece_runs(piece, shape: Sequence[int]) -> list[tuple[int, int]]:
    if is_box(piece):
        return box_runs(shape, piece[1], piece[2])
    return [(piece[1], piece[2] - piece[1])] if piece[2] > piece[1] else []


def overlaps(src: list, dst: list) -> Iterator[tuple[int, int, int]]:
    """``(src_offset, dst_offset, n)``: elements in both run lists, as offsets into each side's storage."""
    i = j = so = do = 0
    while i < len(src) and j < len(dst):
        (a, n), (b, m) = src[i], dst[j]
        lo, hi = max(a, b), min(a + n, b + m)
        if lo < hi:
            yield so + lo - a, do + lo - b, hi - lo
        if a + n <= b + m:
            so, i = so + n, i + 1
        else:
            do, j = do + m, j + 1


def check_boxes(pieces: list, shape: Sequence[int]) -> str | None:
    """Why a list of box pieces does not tile ``shape`` exactly once (None: it does)."""
    for p in pieces:
        offs, sizes = p[1], p[2]
        if not (isinstance(sizes, list) and len(offs) == len(sizes) == len(shape)
                and all(type(x) is int for x in (*offs, *sizes))):
            return f"box {p} does not have one offset and one size per dimension of {list(shape)}"
        if any(s < 1 or o < 0 or o + s > n for o, s, n in zip(offs, sizes, shape)):
            return f"box {p} is empty or leaves the tensor {list(shape)}"
    for a, b in itertools.combinations(pieces, 2):
        if all(max(x, y) < min(x + s, y + t) for x, s, y, t in zip(a[1], a[2], b[1], b[2])):
            return f"boxes {a} and {b} overlap"
    if sum(piece_numel(p) for p in pieces) != math.prod(shape):
        return f"boxes cover {sum(piece_numel(p) for p in pieces)} of {math.prod(shape)} elements"
    return None
