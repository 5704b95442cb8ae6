"""Which (query rows x gathered keys) tiles of the attention a CP rank computes, and how.

Local query rows are this rank's two chunks, gathered keys the 2C chunks in ``Layout.kv_index`` order; each
chunk is a run of consecutive positions, cut into tiles of at most ``Layout.block``. A tile is SKIP (no pair
visible: never computed), FULL (every pair visible: no mask) or PART (``Layout.block_mask`` for that tile only).
Under a causal mask the head-tail layout makes about half of a rank's tiles SKIP.

``uniform``: transformers' eager attention with soft-capping and no sinks adds a dtype-minimum mask, so a query
that sees no key (a left-padded one) attends uniformly over every real key (not the split's padding). Such a
row is "dead": the kernel gives it score 0 on every real key, so the tiles holding dead rows and real keys are
PART even where the causal mask would skip them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .split import Layout

SKIP, FULL, PART = 0, 1, 2


@dataclass
class Plan:
    rows: list            # slices of local query rows
    keys: list            # slices of gathered keys
    state: list           # state[i][j] for rows[i] x keys[j]
    dead: Optional[torch.Tensor]    # (batch, local) bool: rows that attend uniformly (``uniform`` only), or None
    real: torch.Tensor    # (padded,) bool over gathered keys: a real position (not the split's padding)


def _cuts(n_chunks: int, chunk: int, block: int) -> list:
    return [slice(c * chunk + s, c * chunk + min(s + block, chunk))
            for c in range(n_chunks) for s in range(0, chunk, block)]


def plan(layout: Layout, causal: bool, window: Optional[int], uniform: bool) -> Plan:
    """The tiles of this forward for one kind of layer, built once per forward (``Layout._masks`` cache). Tiles
    of consecutive positions (the split's layout) are classified from their position ranges and per-tile key
    validity / document ranges, O(tile) each; otherwise (and for ``uniform``, which needs each row's
    visibility) every tile's mask is built once, one at a time, and never kept."""
    key = ("tiles", causal, window, uniform, layout.block)
    if key in layout._masks:
        return layout._masks[key]
    chunk = layout.q_index.numel() // 2
    block = max(1, min(layout.block, chunk))
    rows, keys = _cuts(2, chunk, block), _cuts(2 * layout.cp, chunk, block)
    real = layout.kv_index < layout.seq_len
    dead = None
    if not uniform and _consecutive(layout.q_index, rows) and _consecutive(layout.kv_index, keys):
        state = [[_by_ranges(layout, causal, window, layout.q_index[r], layout.kv_index[k]) for k in keys]
                 for r in rows]
    else:
        state, live = scan(layout, causal, window, rows, keys)
        if uniform and not bool(live.all()):
            dead = ~live
            for i, r in enumerate(rows):
                if bool(dead[:, r].any()):
                    state[i] = [PART if s == SKIP and bool(real[k].any()) else s for s, k in zip(state[i], keys)]
    layout._masks[key] = Plan(rows, keys, state, dead, real)
    return layout._masks[key]


def scan(layout: Layout, causal: bool, window: Optional[int], rows: list, keys: list):
    """(state per tile, (batch, local) bool: the row sees some key) from every tile's mask, one at a time."""
    live = torch.zeros(layout.key_valid.shape[0], layout.q_index.numel(), dtype=torch.bool)
    state = []
    for r in rows:
        line = []
        for k in keys:
            m = layout.block_mask(causal, window, r, k)
            line.append(FULL if bool(m.all()) else PART if bool(m.any()) else SKIP)
            live[:, r] |= m.any(-1)
        state.append(line)
    return state, live


def _consecutive(index: torch.Tensor, cuts: list) -> bool:
    return all(torch.equal(index[c], torch.arange(int(index[c.start]), int(index[c.start]) + c.stop - c.start))
               for c in cuts)


def _by_ranges(layout: Layout, causal: bool, window: Optional[int], q: torch.Tensor, k: torch.Tensor) -> int:
    """A tile of consecutive query positions ``q`` and key positions ``k``: SKIP only if no pair can be visible,
    FULL only if every pair is (else PART: the tile's mask decides, so a conservative answer stays exact)."""
    q0, q1, k0, k1 = int(q[0]), int(q[-1]), int(k[0]), int(k[-1])
    if (causal and k0 > q1) or (window is not None and k1 <= q0 - window):
        return SKIP                     # no (query, key) pair inside the causal / sliding-window band
    every = (not causal or k1 <= q0) and (window is None or k0 > q1 - window)
    valid = layout.key_valid[:, k0:k1 + 1]
    if not bool(valid.any()):
        return SKIP
    every = every and bool(valid.all())
    if layout.doc is not None:
        qd, kd = layout.doc[:, q0:q1 + 1], layout.doc[:, k0:k1 + 1]
        qlo, qhi, klo, khi = qd.amin(1), qd.amax(1), kd.amin(1), kd.amax(1)
        if bool(((qhi < klo) | (khi < qlo)).all()):
            return SKIP                 # in every row the tile's queries and keys lie in different documents
        every = every and bool(((qlo == qhi) & (klo == khi) & (qlo == klo)).all())
    return FULL if every else PART


def tile_mask(layout: Layout, p: Plan, causal: bool, window: Optional[int], r: slice, k: slice, device):
    """The bool mask (batch, rows, keys) of a PART tile, dead rows seeing every real key."""
    m = layout.block_mask(causal, window, r, k)
    if p.dead is not None:
        m |= p.dead[:, r, None] & p.real[None, None, k]
    return m.to(device, non_blocking=True)
