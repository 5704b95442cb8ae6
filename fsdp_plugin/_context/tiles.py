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
    """The tiles of this forward for one kind of layer, built once per forward (``Layout._masks`` cache): every
    tile's mask is built once here to classify it, one tile at a time, and never kept."""
    key = ("tiles", causal, window, uniform, layout.block)
    if key in layout._masks:
        return layout._masks[key]
    chunk = layout.q_index.numel() // 2
    block = max(1, min(layout.block, chunk))
    rows, keys = _cuts(2, chunk, block), _cuts(2 * layout.cp, chunk, block)
    batch = layout.key_valid.shape[0]
    live = torch.zeros(batch, 2 * chunk, dtype=torch.bool)
    state = []
    for r in rows:
        line = []
        for k in keys:
            m = layout.block_mask(causal, window, r, k)
            line.append(FULL if bool(m.all()) else PART if bool(m.any()) else SKIP)
            live[:, r] |= m.any(-1)
        state.append(line)
    real = layout.kv_index < layout.seq_len
    dead = None
    if uniform and not bool(live.all()):
        dead = ~live
        for i, r in enumerate(rows):
            if bool(dead[:, r].any()):
                state[i] = [PART if s == SKIP and bool(real[k].any()) else s for s, k in zip(state[i], keys)]
    layout._masks[key] = Plan(rows, keys, state, dead, real)
    return layout._masks[key]


def tile_mask(layout: Layout, p: Plan, causal: bool, window: Optional[int], r: slice, k: slice, device):
    """The bool mask (batch, rows, keys) of a PART tile, dead rows seeing every real key."""
    m = layout.block_mask(causal, window, r, k)
    if p.dead is not None:
        m |= p.dead[:, r, None] & p.real[None, None, k]
    return m.to(device, non_blocking=True)
