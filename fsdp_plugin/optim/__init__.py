"""Optimizers that need whole tensors, on a model sharded by ``fp.shard`` (``fp.optim.Muon``; Muon + AdamW as
one optimizer for frameworks that take one, ``fp.optim.MuonWithAdamW``), and the mark that gives a per-tensor
optimizer of yours the exact owner step on shard pieces (``register_per_tensor``; torch's Muon and Adafactor
get it unmarked)."""
from .muon import Muon
from .owner_step import register_per_tensor
from .with_adamw import MuonWithAdamW

__all__ = ["Muon", "MuonWithAdamW", "register_per_tensor"]
