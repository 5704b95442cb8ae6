"""``fp.update_router_bias``: DeepSeek-V3's aux-loss-free balancing on the global batch (issue 55).

Reference: one process on the global batch counts the routes per expert from each router's own output
(``DeepseekV3TopkRouter``'s ``topk_indices``) and applies DeepSeek-V3's rule ``b += rate * sign(mean - load)``
after every step. The sharded run (each rank its own batch) calls ``fp.update_router_bias`` after every step:
every bias within 1e-6 of the reference at every step, and the loss, grad norm and parameters within 1e-5 (the
bias moves the routing of the next step).
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from test_experts import BATCH, SEQ, STEPS, _batch, _build, _check, _global_batch, _optimizer, _train

import fsdp_plugin as fp
from fsdp_plugin.errors import ConfigError

RATE, BIAS_TOL = 0.01, 1e-6


def _biases(model):
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def _reference(world):
    model = _build("deepseek_v3")
    loads = {}

    def hook(name):
        def count(module, args, out):
            loads[name] = loads.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=module.num_experts)
        return count
    for n, m in model.named_modules():
        if type(m).__name__ == "DeepseekV3TopkRouter":
            m.register_forward_hook(hook(n + ".e_score_correction_bias"))
    opt = _optimizer(model.parameters())
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(**_global_batch(s, world)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in loads:
                    f = loads[n].to(torch.float64)
                    b.add_((RATE * torch.sign(f.mean() - f)).to(b.dtype))
        loads.clear()
        out.append((loss.item(), norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()},
                    _biases(model)))
    return out


def _worker(rank, world, ep, extra, local_loads=False):
    model = _build("deepseek_v3")
    fp.shard(model, expert_parallel=ep, timeout_s=60, **extra)
    if local_loads:      # the broken variant: each rank's own loads, never summed over the ranks
        from fsdp_plugin._experts import router_bias
        router_bias.comm.all_reduce = lambda *a, **k: None
    biases = []
    steps = _train(model, _optimizer(model.parameters()), rank, world, STEPS,
                   after=lambda step, m: biases.append(_after(m)))
    return {"steps": steps, "biases": biases}


def _after(model):
    loads = fp.update_router_bias(model, rate=RATE)
    return _biases(model), {n: int(v.sum()) for n, v in loads.items()}


def _check_biases(results, want):
    for rank, res in enumerate(results):
        for s, ((got, loads), (*_, wb)) in enumerate(zip(res["biases"], want)):
            assert set(got) == set(wb) and got
            for n, v in got.items():
                diff = (v - wb[n]).abs().max().item()
                assert diff <= BIAS_TOL, f"rank {rank} step {s}: {n} off by {diff:.2e}"
    for res in results:     # every (token, k) route of the global batch once (twice would not move the sign)
        for _, loads in res["biases"]:
            assert set(loads.values()) == {len(results) * BATCH * SEQ * 2}, loads


# activation checkpointing of the MoE blocks (whole decoder layers of DeepSeek-V3 fail torch's recompute check in
# one process too, transformers 5.24): the recompute runs the experts again, the loads are counted once
AC_MOE = {"activation_checkpointing": fp.Checkpointing(modules={DeepseekV3MoE})}


@pytest.mark.parametrize("world,ep,extra", [(2, 2, {}), (4, 2, AC_MOE), (2, None, {})],
                         ids=["world2-ep2", "world4-ep2-ac", "world2-no-ep"])
def test_router_bias_update_on_global_loads(world, ep, extra):
    want = _reference(world)
    results = run_ranks(_worker, world, ep, extra, timeout=240)
    _check_biases(results, want)
    _check(results, [w[:3] for w in want])
    moved = [(want[-1][3][n] - v).abs().max().item() for n, v in _biases(_build("deepseek_v3")).items()]
    assert max(moved) > 0


def test_router_bias_check_can_fail():
    """Per-rank loads (no sum over the ranks) give another bias than one process on the global batch."""
    want = _reference(2)
    results = run_ranks(_worker, 2, 2, {}, True, timeout=240)
    with pytest.raises(AssertionError, match="e_score_correction_bias off by"):
        _check_biases(results, want)


def test_router_bias_refusals():
    with pytest.raises(fp.ShardingError, match="not sharded"):
        fp.update_router_bias(_build("deepseek_v3"))
    model = fp.shard(_build("qwen3_moe"))
    with pytest.raises(ConfigError, match="has no router bias"):
        fp.update_router_bias(model)
    model = fp.shard(_build("deepseek_v3"))
    with pytest.raises(ConfigError, match="positive float"):
        fp.update_router_bias(model, rate=-1.0)
    with pytest.raises(ConfigError, match="no route was counted"):
        fp.update_router_bias(model)      # no backward yet
    with torch.no_grad():
        model(**_batch(0, 0))             # an evaluation forward counts nothing
    with pytest.raises(ConfigError, match="no route was counted"):
        fp.update_router_bias(model)
    model(**_batch(0, 0)).loss.backward()
    loads = fp.update_router_bias(model)
    assert all(int(v.sum()) == 2 * 8 * 2 for v in loads.values())     # batch 2 x seq 8 tokens, top 2
