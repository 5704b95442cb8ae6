"""Optimizers that need whole tensors, on a model sharded by ``fp.shard`` (``fp.optim.Muon``; Muon + AdamW as
one optimizer for frameworks that take one, ``fp.optim.MuonWithAdamW``), and the mark that makes the sharding
guard refuse a per-tensor optimizer of yours on shard pieces."""
from .._build.guards import register_per_tensor
from .muon import Muon
from .with_adamw import MuonWithAdamW

__all__ = ["Muon", "MuonWithAdamW", "register_per_tensor"]
