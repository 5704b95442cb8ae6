"""Test helpers for the checkpoint tests (no tests here).

``FakeLayout`` stands in for ``fsdp_plugin._layout`` until/unless the engine is used: ``fake_shard(model,
world, rank, strategy)`` turns a plain model into a "sharded" one the way a flat-parameter engine does
(all parameters flattened and concatenated, split into equal chunks, each parameter's ``p.data`` replaced by
its 1-D piece). Models not sharded this way fall through to the real ``_layout`` (or a plain description).
"""
from __future__ import annotations

import importlib
import math
import sys
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamShard:
    fqn: str
    aliases: tuple
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int
    writer: bool


@dataclass(frozen=True)
class ShardingInfo:
    strategy: str
    world_size: int
    rank: int
    shard_size: int
    replicate_size: int


_REG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REAL = None


def _names_by_param(model):
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (p, []))[1].append(name)
    return list(groups.values())


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def param_shards(model):
    if model in _REG:
        return _REG[model][0]
    if _REAL is not None:
        return _REAL.param_shards(model)
    return [ParamShard(names[0], tuple(names[1:]), p, p.shape, p.dtype, 0, p.numel(), _rank() == 0)
            for p, names in _names_by_param(model)]


def sharding_info(model):
    if model in _REG:
        return _REG[model][1]
    if _REAL is not None:
        return _REAL.sharding_info(model)
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return ShardingInfo("no_shard", world, _rank(), 1, world)


def fake_shard(model, world: int, rank: int, strategy: str = "full_shard", replicate: int = 1):
    """Shard ``model`` in place like a flat-parameter engine; hybrid: ``replicate`` replica groups."""
    shard_size = world // replicate
    s, replica = rank % shard_size, rank // shard_size
    entries = _names_by_param(model)
    total = sum(p.numel() for p, _ in entries)
    chunk = math.ceil(total / shard_size) if total else 0
    lo_r, hi_r = s * chunk, (s + 1) * chunk
    shards, off = [], 0
    for p, names in entries:
        n = p.numel()
        lo, hi = max(lo_r - off, 0), min(hi_r - off, n)
        lo, hi = (lo, hi) if lo < hi else (0, 0)
        shape = p.shape
        p.data = p.data.reshape(-1)[lo:hi].clone()
        shards.append(ParamShard(names[0], tuple(names[1:]), p, shape, p.dtype, lo, hi, replica == 0))
        off += n
    _REG[model] = (shards, ShardingInfo(strategy, world, rank, shard_size, replicate))
    return model


def install(monkeypatch=None):
    """Make ``fsdp_plugin._layout`` resolve to this fake (wrapping the real one if it exists)."""
    global _REAL
    if _REAL is None:
        try:
            real = importlib.import_module("fsdp_plugin._layout")
            _REAL = None if real is sys.modules[__name__] else real
        except ImportError:
            _REAL = None
    mod = sys.modules[__name__]
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "fsdp_plugin._layout", mod)
    else:
        sys.modules["fsdp_plugin._layout"] = mod


def full_from_pieces(pieces, shape, dtype):
    """Reassemble a full tensor from ``[(start, end, tensor_1d)]`` (test-only)."""
    out = torch.full((math.prod(shape),), float("nan"), dtype=torch.float64).to(dtype)
    for a, b, t in pieces:
        out[a:b] = t.reshape(-1)
    return out.reshape(shape)


class TiedNet(nn.Module):
    """Embedding tied to the head, a frozen layer, a persistent and a non-persistent buffer."""

    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1 = nn.Linear(d, 7)
        self.frozen = nn.Linear(7, d)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("counts", torch.arange(5))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx):
        h = torch.tanh(self.l1(self.emb(idx) * self.scale))
        return self.head(self.frozen(h))


_ = types  # keep import for type hints in older Pythons
