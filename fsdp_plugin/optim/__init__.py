"""Optimizers that need whole tensors, on a model sharded by ``fp.shard`` (``fp.optim.Muon``), and the mark
that makes the sharding guard refuse a per-tensor optimizer of yours on shard pieces."""
from .._build.guards import register_per_tensor
from .muon import Muon

__all__ = ["Muon", "register_per_tensor"]
