"""N→M resume with the real engine: bit-exact state after load, identical losses after resuming.

Each save run trains a few steps at world N, saves, then keeps training ("uninterrupted" reference);
each load run builds a differently initialized model at world M, loads into a fresh optimizer (no state
yet), checks the full state is bit-identical, and trains the same steps.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from models import GPT, Block

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import load_checkpoint, save_checkpoint

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

GLOBAL_BATCH, SEQ, VOCAB = 12, 16, 64
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _batch(step, rank, world):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    rows = idx[rank * per:(rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def _build(seed, strategy, world):
    torch.manual_seed(seed)
    model = GPT(vocab=VOCAB, d=16, n_layer=2, seq=SEQ)
    kw = {"device_mesh": (world // 2, 2)} if strategy == "hybrid_shard" else {}
    fp.shard(model, sharding_strategy=strategy, auto_wrap_policy={Block}, **kw)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 1 and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 1 and "ln" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3)
    return model, opt


def _step(model, opt, step, rank, world):
    x, y = _batch(step, rank, world)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= world
    return t.item()


def _state(model, opt):
    """Full params (rank 0) and every rank's optimizer pieces, for bit-exact comparison in the parent."""
    full = fp.full_state_dict(model)
    from fsdp_plugin._flat.layout import param_shards

    pieces = {}
    for sh in param_shards(model):
        st = opt.state.get(sh.param, {})
        pieces[sh.fqn] = (sh.start, sh.end, {k: v.detach().clone() for k, v in st.items()})
    return full, pieces


def _save_run(rank, world, path, strategy):
    model, opt = _build(0, strategy, world)
    for step in range(STEPS_BEFORE):
        _step(model, opt, step, rank, world)
    save_checkpoint(path, model, opt, extra={"step": STEPS_BEFORE, "world": world})
    state = _state(model, opt)
    losses = [_step(model, opt, STEPS_BEFORE + i, rank, world) for i in range(STEPS_AFTER)]
    return losses, state


def _load_run(rank, world, path, strategy):
    model, opt = _build(123, strategy, world)
    extra = load_checkpoint(path, model, opt)
    assert extra["step"] == STEPS_BEFORE
    state = _state(model, opt)
    losses = [_step(model, opt, extra["step"] + i, rank, world) for i in range(STEPS_AFTER)]
    return losses, state


def _assert_same_state(a, b):
    (full_a, _), (full_b, _) = a[0], b[0]
    assert full_a.keys() == full_b.keys()
    for k in full_a:
        assert torch.equal(full_a[k], full_b[k]), k
    opt_a, opt_b = _gather_opt(a), _gather_opt(b)
    assert opt_a.keys() == opt_b.keys()
    for k in opt_a:
        assert torch.equal(opt_a[k], opt_b[k]), k


def _gather_opt(per_rank):
    """{(fqn, key): full 1-D tensor} assembled from the ranks' pieces (scalars: rank 0's value)."""
    out = {}
    for _, pieces in per_rank:
        for fqn, (a, b, st) in pieces.items():
            for key, v in st.items():
                if v.dim() == 0:
                    out.setdefault((fqn, key), v)
                elif v.numel():  # empty pieces carry nothing (and may share a start)
                    out.setdefault((fqn, key), {})[a] = v.reshape(-1)
    return {k: (v if isinstance(v, torch.Tensor) else torch.cat([v[s] for s in sorted(v)])) for k, v in out.items()}


def _roundtrip(tmp_path, n, m, s_save, s_load):
    path = str(tmp_path / f"ck-{n}-{m}")
    saved = run_ranks(_save_run, n, path, s_save, timeout=120)
    loaded = run_ranks(_load_run, m, path, s_load, timeout=120)
    _assert_same_state([s for _, s in saved], [s for _, s in loaded])
    ref, got = saved[0][0], loaded[0][0]
    assert max(abs(x - y) for x, y in zip(ref, got)) <= 1e-6, (ref, got)


@pytest.mark.parametrize("n,m", [(2, 3), (4, 1), (1, 2), (3, 4)])
def test_resume_across_world_sizes(tmp_path, n, m):
    _roundtrip(tmp_path, n, m, "full_shard", "full_shard")


@pytest.mark.parametrize("s_save,s_load", [("hybrid_shard", "full_shard"), ("no_shard", "shard_grad_op")])
def test_resume_across_strategies(tmp_path, s_save, s_load):
    _roundtrip(tmp_path, 4 if s_save == "hybrid_shard" else 2, 3, s_save, s_load)


@pytest.mark.slow
@pytest.mark.parametrize("n,m", list(itertools.product([1, 2, 3, 4], repeat=2)))
def test_resume_all_pairs(tmp_path, n, m):
    _roundtrip(tmp_path, n, m, "full_shard", "full_shard")
