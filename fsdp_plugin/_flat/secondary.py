"""hpZ's secondary shard (``ShardingConfig(reshard_after_forward=<int r>)``, FSDP2's meaning).

After a unit's forward the handle keeps, instead of nothing, slice ``j`` (``padded / r`` elements, compute dtype) of
the full buffer it just used, where ``j`` is its rank in its *secondary group*: ``r`` consecutive ranks of its
shard group (inside one node under torchrun's node-major ranks when ``r`` divides the ranks per node). The
backward all-gather then runs over that group only, from these slices: the same values as the forward's, so
training is bit-identical to full_shard's. The slice is consumed by that all-gather (or dropped at the end of
backward, by a forward outside backward, by fp.reset): it is never used after the parameters may have changed,
and never saved (checkpoints read the master shard). Memory: +``padded·c/r`` bytes per handle between its
forward and its backward (c: compute dtype size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SecondaryShard:
    """A handle's secondary group (``size`` ranks; this rank is ``rank`` in it) and its slice, when held."""

    group: object
    size: int
    rank: int
    tensor: Optional[torch.Tensor] = None

    def keep(self, full: torch.Tensor) -> None:
        """Copy this rank's slice of the just-used full buffer (it is freed next)."""
        n = full.numel() // self.size
        self.tensor = full[self.rank * n:(self.rank + 1) * n].clone()

    def take(self) -> Optional[torch.Tensor]:
        """The held slice (None if none), handed to the all-gather that consumes it."""
        t, self.tensor = self.tensor, None
        return t

    def drop(self) -> None:
        self.tensor = None

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()
