"""``fp.compile``: each innermost unit's forward compiled, hooks outside; fp32 parity with eager."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from models import GPT, Block, gpt_batch

import fsdp_plugin as fp
from fsdp_plugin._compile import compiled_units


def _train(model, steps, rank=0, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _make():
    torch.manual_seed(0)
    return fp.shard(GPT(vocab=64, d=32, n_layer=2, seq=16), auto_wrap_policy={Block})


def test_compile_per_unit_matches_eager_without_graph_breaks():
    """aot_eager: dynamo + AOTAutograd as inductor would see them, without code generation (fast)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref_losses, ref_params = _train(_make(), 3)
    model = fp.compile(_make(), backend="aot_eager")
    assert compiled_units(model) == ["blocks.0", "blocks.1"]  # the root (embeddings, head) stays eager
    losses, params = _train(model, 3)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(params, ref_params))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both blocks; new views each step: no recompile
    fp.compile(model, backend="eager")  # again: replaces the compilation, does not nest it
    assert model.blocks[0].forward._torchdynamo_orig_callable == model.blocks[0]._fp_eager_forward


def test_compile_needs_a_sharded_model():
    with pytest.raises(fp.ShardingError, match="fp.shard"):
        fp.compile(GPT())


def _inductor_rank(rank, world, compiled):
    torch.manual_seed(0)
    model = fp.shard(GPT(vocab=64, d=32, n_layer=2, seq=16), auto_wrap_policy={Block})
    if compiled:
        fp.compile(model)  # inductor (C++ on CPU)
    return _train(model, 3, rank, world)[0]


@pytest.mark.slow
def test_compile_inductor_world2_parity():
    eager = run_ranks(_inductor_rank, 2, False, timeout=300)
    compiled = run_ranks(_inductor_rank, 2, True, timeout=900)
    for a, b in zip(eager, compiled):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
