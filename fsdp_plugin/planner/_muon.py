"""fp.optim.Muon's step in the plan: owner-exchange bytes and Newton–Schulz FLOPs per rank, from the layout.

The planner does not know the user's parameter groups: ``optimizer="muon"`` counts every parameter with two
or more dimensions as Muon's (the README recipe sends embeddings and the head to AdamW instead). Uses the
engine's own layout and owner rules (``row_aligned_offsets``, ``choose_owners``), so the bytes equal what
``fp.comm_stats`` counts as ``optim_exchange`` on each rank.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

from .._flat.owners import choose_owners, ns_cost
from .._flat.rows import piece, row_aligned_offsets

NS_STEPS = 5        # torch.optim.Muon's default


class _Layout:
    """What ``choose_owners`` reads of a FlatParamHandle, for one handle's shapes on ``n`` shard ranks."""

    def __init__(self, shapes: list, n: int):
        offsets, padded = row_aligned_offsets(shapes, n)
        self.chunk = padded // n
        self.mesh = SimpleNamespace(shard_size=n)
        self.slots = [SimpleNamespace(shape=tuple(s), numel=math.prod(s), offset=o) for s, o in zip(shapes, offsets)]

    def piece_of(self, slot, j: int) -> tuple[int, int]:
        return piece(slot.offset, slot.numel, self.chunk, j)


def muon_step(shapes_per_handle: list, n: int, ns_steps: int = NS_STEPS) -> tuple[list, list, int]:
    """``(bytes_sent[r], ns_flops[r], calls)`` per shard rank ``r`` for one step over handles' shapes."""
    sent, flops, calls = [0] * n, [0] * n, 0
    for shapes in shapes_per_handle:
        lay = _Layout(shapes, n)
        owners = choose_owners(lay)
        split = False
        for slot, owner in zip(lay.slots, owners):
            if len(slot.shape) < 2 or slot.numel == 0:
                continue
            pieces = [lay.piece_of(slot, j) for j in range(n)]
            if len(slot.shape) == 2 and all(hi - lo < slot.numel for lo, hi in pieces):
                split = True
                flops[owner] += 2 * ns_steps * ns_cost(slot.shape)
                for j, (lo, hi) in enumerate(pieces):
                    if j != owner and hi > lo:
                        sent[j] += 2 * (hi - lo)          # bf16 piece to the owner
                        sent[owner] += 2 * (hi - lo)      # bf16 result rows back
                continue
            per_row = ns_cost(slot.shape) // slot.shape[0] if len(slot.shape) > 2 else ns_cost(slot.shape)
            for j, (lo, hi) in enumerate(pieces):
                rows = (hi - lo) // max(1, slot.numel // slot.shape[0]) if len(slot.shape) > 2 else int(hi > lo)
                flops[j] += 2 * ns_steps * per_row * rows
        calls += 2 if split and n > 1 else 0
    return sent, flops, calls
