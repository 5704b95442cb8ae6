"""Optimizers that need whole tensors, on a model sharded by ``fp.shard`` (``fp.optim.Muon``)."""
from .muon import Muon

__all__ = ["Muon"]
