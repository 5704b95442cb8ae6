"""``ShardingConfig(expert_capacity_factor=c)`` (issue 55): token dropping under expert parallelism, opt-in and
inexact by design (the model is dropless), but deterministic: each rank keeps, per expert and experts call, the
first ``ceil(c * tokens * top_k / num_experts)`` routes of its own tokens in token order.

Reference: one process on the global batch whose experts modules zero the routing weight of exactly those routes,
computed per rank's chunk of the global batch (the chunks are the ranks' batches, rank-major). 4 AdamW steps,
every step within 1e-5; the dropless reference does not match (drops happen and change the numbers).
"""
from __future__ import annotations

import math

import pytest
import torch
from _dist import run_ranks
from test_experts import BATCH, MARGIN, SEQ, STEPS, _Margin, _batch, _build, _check, _global_batch, _optimizer, _train

import fsdp_plugin as fp
from fsdp_plugin.errors import ConfigError


def _drop_like_the_ranks(model, factor, world, dropped):
    """Each experts module zeroes the weights of the routes a rank would drop (per rank chunk of the tokens)."""
    for m in model.modules():
        if not hasattr(m, "_is_expert_parallel"):
            continue
        original = m.forward

        def forward(hidden, index, weights, _original=original, _n=m.num_experts):
            t, k = index.shape
            chunk = t // world
            cap = math.ceil(factor * chunk * k / _n)
            keep = torch.zeros_like(index, dtype=torch.bool)
            for r in range(world):
                part = index[r * chunk:(r + 1) * chunk].reshape(-1)
                seen = torch.zeros(_n, dtype=torch.long)
                flags = []
                for e in part.tolist():      # token order, then slot order: the first `cap` routes per expert
                    flags.append(bool(seen[e] < cap))
                    seen[e] += 1
                keep[r * chunk:(r + 1) * chunk] = torch.tensor(flags).view(chunk, k)
            dropped[0] += int((~keep).sum())
            return _original(hidden, index, weights * keep.to(weights.dtype))
        m.forward = forward


def _reference(world, factor):
    model = _build("qwen3_moe", impl="eager")
    dropped = [0]
    if factor is not None:
        _drop_like_the_ranks(model, factor, world, dropped)
    margin = _Margin(model)
    opt = _optimizer(model.parameters())
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(**_global_batch(s, world)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        out.append((loss.item(), norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert margin.value >= MARGIN
    return out, dropped[0]


def _worker(rank, world, factor):
    model = _build("qwen3_moe", impl="eager")
    fp.shard(model, expert_parallel=2, expert_capacity_factor=factor, timeout_s=60)
    return {"steps": _train(model, _optimizer(model.parameters()), rank, world, STEPS)}


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_capacity_drops_the_first_routes_over_capacity_per_rank(factor):
    """1.0: routes are dropped (the dropless reference differs); 2.0 = num_experts / top_k: capacity is every
    token, nothing dropped, the dropless numbers."""
    want, dropped = _reference(2, factor)
    results = run_ranks(_worker, 2, factor, timeout=240)
    _check(results, want)
    if factor < 2.0:
        assert dropped > 0
        with pytest.raises(AssertionError):
            _check(results, _reference(2, None)[0])
    else:
        assert dropped == 0


def test_capacity_factor_is_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="positive float"):
        fp.ShardingConfig(expert_parallel=2, expert_capacity_factor=0)
    with pytest.raises(ConfigError, match="positive float"):
        fp.ShardingConfig(expert_parallel=2, expert_capacity_factor=True)
    with pytest.raises(ConfigError, match="without expert_parallel"):
        fp.ShardingConfig(expert_capacity_factor=1.25)


def _per_expert_reference(world, factor):
    """One process, each rank's batch forwarded on its own (the mean of their losses: the ranks' averaged
    gradient), every expert keeping the first ``ceil(factor * routes / num_experts)`` rows of its call."""
    import test_experts_per_expert as tp
    model = tp._build()
    routes = BATCH * SEQ * tp.TOP_K
    cap = math.ceil(factor * routes / tp.N_EXPERTS)
    margin = tp._margin(model)
    dropped = [0]
    for layer in model.model.layers:
        for e in layer.mlp.experts:
            original = e.forward

            def forward(rows, _original=original):
                dropped[0] += max(0, rows.shape[0] - cap)
                out = _original(rows[:cap])
                return torch.cat([out, out.new_zeros((rows.shape[0] - out.shape[0], out.shape[1]))])
            e.forward = forward
    opt = _optimizer(model.parameters())
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = sum(model(**_batch(s, r)).loss for r in range(world)) / world
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        out.append((loss.item(), norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    assert MARGIN <= margin[0] < float("inf")
    return out, dropped[0]


def _per_expert_worker(rank, world, factor):
    import test_experts_per_expert as tp
    model = tp._build()
    fp.shard(model, expert_parallel=2, expert_capacity_factor=factor, timeout_s=60)
    return {"steps": _train(model, _optimizer(model.parameters()), rank, world, STEPS)}


def test_capacity_with_the_per_expert_form():
    """The per-expert form (a ModuleList of experts) drops the same way: each expert keeps the first rows of each
    rank's block call up to ``ceil(factor * routes / num_experts)``; the dropped rows add nothing."""
    want, dropped = _per_expert_reference(2, 0.75)
    assert dropped > 0
    results = run_ranks(_per_expert_worker, 2, 0.75, timeout=240)
    _check(results, want)
    with pytest.raises(AssertionError):      # the drops matter: dropless is another run
        _check(results, _per_expert_reference(2, 2.0)[0])
