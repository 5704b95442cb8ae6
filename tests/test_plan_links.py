"""fp.plan across nodes: inter-node bytes per kind equal the engine's ``fp.comm_stats.inter_node_bytes``; links
price the node egress; hpZ's secondary shards are in the memory plan; ``recommend`` picks a configuration."""
import dataclasses

import pytest
import torch

import fsdp_plugin as fp
from fsdp_plugin.planner._recommend import resolve
from fsdp_plugin.planner._time import default_for
from tests._dist import run_ranks
from tests.models import GPT, Block, gpt_batch

CASES = {"full_shard": {}, "shard_grad_op": {"sharding_strategy": "shard_grad_op"},
         "hybrid_shard": {"sharding_strategy": "hybrid_shard"}, "hpz": {"reshard_after_forward": "node"},
         # quantized across nodes: hybrid's in-node shard collectives stay exact, ZeRO++ (hpZ + qwZ + qgZ)
         "hybrid_q8": {"sharding_strategy": "hybrid_shard",
                       "quantization": fp.Quantization(weights="int8", gradients="int8")},
         "zeropp": {"reshard_after_forward": "node", "quantization": fp.Quantization(weights="int8", gradients="int8")}}


def _engine(rank, world, kwargs):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, **kwargs)
    opt = torch.optim.AdamW(model.parameters())
    model(*gpt_batch(0, rank)).backward()
    opt.step()
    fp.comm_stats.reset()
    for step in (1, 2):
        model(*gpt_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    return ({k: v // 2 for k, v in fp.comm_stats.inter_node_bytes.items() if k != "control" and v},
            {k: v // 2 for k, v in fp.comm_stats.bytes.items() if k != "control"})


@pytest.mark.parametrize("name", sorted(CASES))
def test_planned_inter_node_bytes_equal_the_engines(name):
    kwargs = resolve(CASES[name], 2)
    inter, total = run_ranks(_engine, 4, kwargs, env={"LOCAL_WORLD_SIZE": "2"})[0]
    plan = fp.plan(GPT, world_size=4, auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0), nodes=2,
                   link_gbps=1, **kwargs)
    w = plan.worlds[4]
    assert w.wire_bytes == total
    assert w.inter_node_bytes == inter
    assert w.link_bytes_per_node == 2 * sum(inter.values())
    assert w.link_s == pytest.approx(w.link_bytes_per_node / 125e6)


def test_hpz_plan_holds_the_secondary_shards_and_moves_backward_gathers_into_the_node():
    kw = dict(auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0), nodes=2, link_gbps=0.2)
    full = fp.plan(GPT, world_size=4, reshard_after_forward=True, **kw).worlds[4]
    hpz = fp.plan(GPT, world_size=4, reshard_after_forward=2, **kw).worlds[4]
    non_root = sum(u["bytes"] for u in fp.plan(GPT, world_size=4, **kw).units[1:])
    assert hpz.secondary_shards >= non_root // 2 > 0 and full.secondary_shards == 0
    assert hpz.wire_bytes["all_gather"] < full.wire_bytes["all_gather"]
    assert hpz.inter_node_bytes["all_gather"] < full.inter_node_bytes["all_gather"]
    assert "all_gather/secondary" in hpz.wire_groups


def test_recommend_takes_quantized_options_only_when_asked_and_where_the_link_is_the_step():
    """Quantized candidates (not exact) join only when passed; their kernels are priced, so a slow link picks
    one and a fast one does not."""
    table = {**fp.planner.CANDIDATES, **fp.planner.QUANTIZED_CANDIDATES}
    opts = dict(auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0))
    slow, _ = fp.planner.recommend(GPT, 4, nodes=2, link_gbps=0.01, candidates=table, **opts)
    fast, plans = fp.planner.recommend(GPT, 4, nodes=2, link_gbps=1000, candidates=table, **opts)
    assert slow in fp.planner.QUANTIZED_CANDIDATES and fast in fp.planner.CANDIDATES
    # the kernels are priced: dearer quantization makes the quantized plan, and only it, slower
    dear = dataclasses.replace(default_for(torch.device("cpu")), quantize_s_per_elem=1e-6)
    _, dear_plans = fp.planner.recommend(GPT, 4, nodes=2, link_gbps=1000, candidates=table, calibration=dear, **opts)
    assert dear_plans["hybrid_q8g"].worlds[4].step_s > plans["hybrid_q8g"].worlds[4].step_s
    assert dear_plans["hybrid_shard"].worlds[4].step_s == pytest.approx(plans["hybrid_shard"].worlds[4].step_s)


def test_recommend_prefers_hybrid_or_hpz_on_a_slow_link_and_bad_values_are_refused():
    best, plans = fp.planner.recommend(GPT, 4, nodes=2, link_gbps=0.01, auto_wrap_policy={Block},
                                       inputs=lambda: gpt_batch(0, 0))
    assert best == min(plans, key=lambda n: plans[n].worlds[4].link_bytes_per_node)
    with pytest.raises(fp.PlanError, match="does not split into nodes=3"):
        fp.plan(GPT, world_size=4, nodes=3, link_gbps=1, inputs=lambda: gpt_batch(0, 0))
    with pytest.raises(fp.PlanError, match="link_gbps"):
        fp.plan(GPT, world_size=4, nodes=2, link_gbps=0, inputs=lambda: gpt_batch(0, 0))
