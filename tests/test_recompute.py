"""Activation checkpointing around units (issue 26): torch's default early stop, nested units, prefetch.

Non-reentrant checkpointing recomputes a module's forward in backward and, with ``early_stop=True`` (torch's
default), stops by raising inside the forward once the last saved tensor it needs exists. When that forward is
a unit's (the unit runs last in the checkpointed region, or the region is the unit's own ``__call__``), the
unit's post-forward hook sees an exception in the middle of backward and must keep its parameters: the
recomputed tensors alias them. Recompute must also issue no collective the backward schedule does not plan.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fsdp_plugin as fp
from _dist import run_ranks

D = 8


class Sub(nn.Module):
    """One Linear + tanh: a unit nested inside a checkpointed block."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Mid(nn.Module):
    """A unit whose own nested unit runs last (two levels of units under the checkpointed block)."""

    def __init__(self):
        super().__init__()
        self.lin, self.sub = nn.Linear(D, D), Sub()

    def forward(self, x):
        return self.sub(self.lin(x).relu())


class Block(nn.Module):
    """Three layers; the one at ``pos`` is a nested unit ("first", "middle", "last", "deep": a `Mid` last)."""

    def __init__(self, pos: str):
        super().__init__()
        nested = Mid() if pos == "deep" else Sub()
        at = {"first": 0, "middle": 1}.get(pos, 2)
        layers = [nn.Linear(D, D), nn.Linear(D, D)]
        layers.insert(at, nested)
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h) if isinstance(layer, (Sub, Mid)) else layer(h).relu()
        return x + h


class Net(nn.Module):
    """``call_ac``: checkpoint each block's ``__call__`` from the parent (Hugging Face style), so the early stop
    raises inside a unit's own forward; otherwise fp.shard's ``activation_checkpointing`` wraps the forward."""

    def __init__(self, pos: str, n_blocks: int = 3, call_ac: bool = False):
        super().__init__()
        self.call_ac = call_ac
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 2)
        self.blocks = nn.ModuleList(Block(pos) for _ in range(n_blocks))

    def forward(self, x, boom: bool = False):
        h = self.inp(x)
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=False) if self.call_ac else blk(h)
            if boom:
                raise RuntimeError("boom in forward")
        return self.head(h).pow(2).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _build(pos: str, ac: str, units=(Block, Sub, Mid), **kw) -> nn.Module:
    torch.manual_seed(0)
    model = Net(pos, call_ac=ac == "call")
    return fp.shard(model, auto_wrap_policy=set(units), activation_checkpointing={Block} if ac == "fp" else None,
                    **kw)


def _grads_after_steps(model, rank: int, steps: int = 3) -> list:
    """Local gradient shards of every step (SGD with momentum between steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for s in range(steps):
        opt.zero_grad()
        model(_batch(s, rank)).backward()
        out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return out


def _first_diff(want, got) -> str:
    for s, (w, g) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(w, g)):
            if not torch.equal(a, b):
                return f"step {s} parameter {i}: max |diff| {(a - b).abs().max().item():.3g}"
    return "equal"


def _bit_equal(want, got) -> bool:
    return all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))


def _positions_bit_equal(rank, world, pos):
    assert getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) in (None, True)  # torch default
    plain = _grads_after_steps(_build(pos, "none"), rank)
    verdicts = {}
    for ac in ("fp", "call"):
        got = _grads_after_steps(_build(pos, ac), rank)
        verdicts[ac] = True if _bit_equal(plain, got) else _first_diff(plain, got)
    return verdicts


@pytest.mark.parametrize("pos", ["first", "middle", "last", "deep"])
def test_nested_units_under_checkpointing_match_bit_for_bit(pos):
    for verdicts in run_ranks(_positions_bit_equal, 2, pos):
        assert verdicts == {"fp": True, "call": True}, verdicts


def _reset_after_real_forward_error(rank, world):
    model = _build("last", "fp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="boom in forward"):
        model(_batch(0, rank), boom=True)
    fp.reset(model)
    root = model._fp_root
    assert all(not h.is_unsharded or h._aliases_shard for u in root.units for h in u.handles)
    got = []
    for s in range(2):
        opt.zero_grad()
        model(_batch(s, rank)).backward()
        got.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    want = _grads_after_steps(_build("last", "fp"), rank, steps=2)
    return _bit_equal(want, got)


def test_reset_after_an_exception_in_a_real_forward_under_checkpointing():
    assert run_ranks(_reset_after_real_forward_error, 2) == [True, True]


_PREFETCH = [dict(forward_prefetch=f, backward_prefetch=b, limit_all_gathers=lim)
             for f, b, lim in itertools.product((False, True), repeat=3)]


def _gathers_per_step(model, rank: int, steps: int = 3) -> list:
    out = []
    for s in range(steps):
        fp.comm_stats.reset()
        model(_batch(s, rank)).backward()
        out.append((fp.comm_stats.calls["all_gather"], fp.comm_stats.bytes["all_gather"]))
    return out


def _prefetch_counts(rank, world, units):
    rows = []
    for kw in _PREFETCH:
        plain = _gathers_per_step(_build("middle", "none", units, **kw), rank)
        rows.append((kw, plain, [_gathers_per_step(_build("middle", ac, units, **kw), rank)
                                 for ac in ("fp", "call")]))
    return rows


@pytest.mark.parametrize("units", [(Block,), (Block, Sub)], ids=["blocks", "blocks+nested"])
def test_recompute_issues_exactly_the_planned_all_gathers(units):
    for kw, plain, with_ac in run_ranks(_prefetch_counts, 2, units)[0]:
        assert plain[0][0] > 0
        for ac in with_ac:
            assert ac == plain, f"{kw}: (all-gathers, bytes) per step {ac} with checkpointing, {plain} without"
