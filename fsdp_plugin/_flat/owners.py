"""Who owns each parameter of a flat handle: the shard rank that does its per-matrix work.

A parameter whole on one shard rank is owned by that rank. A parameter split across ranks (a matrix cut
between rows) gets an owner chosen by LPT on Newton–Schulz cost inside its handle: split parameters,
costliest first, go to the rank with the least cost so far (whole matrices count for the rank holding them);
ties go to the rank holding the most of the parameter (less to send), then the lowest rank. Deterministic
from the layout alone, so every rank of the shard group computes the same owners without communicating.
"""
from __future__ import annotations

import math
from typing import Sequence


def ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton–Schulz iteration on ``shape`` (a matrix, or a stack of matrices over the
    leading dimensions); 0 for 0-d and 1-D shapes. Per iteration: ``X X^T`` (s·s·l), ``G G`` (s³) and
    ``G X`` (s·s·l) with ``s``/``l`` the short/long side."""
    if len(shape) < 2:
        return 0
    a, b = shape[-2], shape[-1]
    s, l = min(a, b), max(a, b)
    return math.prod(shape[:-2]) * s * s * (2 * l + s)


def choose_owners(handle) -> list[int]:
    """Owner shard rank of every slot of ``handle`` (a FlatParamHandle), in slot order."""
    n = handle.mesh.shard_size
    owners, load, split = [0] * len(handle.slots), [0] * n, []
    for i, s in enumerate(handle.slots):
        sizes = [hi - lo for lo, hi in (handle.piece_of(s, j) for j in range(n))]
        whole = [j for j in range(n) if sizes[j] == s.numel]
        if s.numel == 0 or whole:
            owners[i] = whole[0] if whole else 0
            load[owners[i]] += ns_cost(s.shape)
        else:
            split.append((i, sizes))
    for i, sizes in sorted(split, key=lambda t: -ns_cost(handle.slots[t[0]].shape)):
        cost = ns_cost(handle.slots[i].shape)
        owners[i] = min(range(n), key=lambda j: (load[j] if cost else 0, -sizes[j], j))
        load[owners[i]] += cost
    return owners
