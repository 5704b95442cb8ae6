"""fp.plan(..., expert_parallel=E) (issue 55): the experts' own handles (their gathers over shard_size / E ranks,
none where shard_size == E), the all-to-alls at uniform routing, the receive buffer under the worst imbalance,
and the comparison with gathering the experts whole. A real EP run at world 2 whose router is forced to route
uniformly (every token: one expert on each EP rank) moves exactly the bytes the plan says, kind by kind."""
import types

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from _dist import run_ranks

import fsdp_plugin as fp
from fsdp_plugin.planner import PlanError

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB, HIDDEN, EXPERTS, TOP_K, LAYERS, SEQ, BATCH = 96, 32, 4, 2, 2, 8, 2


def tiny_qwen3_moe(experts=EXPERTS):
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, moe_intermediate_size=32, num_experts=experts,
        num_experts_per_tok=TOP_K, head_dim=8))


def _plan(ep, world=(2, 4), **kw):
    return fp.plan(kw.pop("build", tiny_qwen3_moe), world_size=list(world), expert_parallel=ep, seq_len=SEQ,
                   batch_size=BATCH, device="cpu", **kw)


def _a2a_formula(ep, recompute=False):
    """Per step and rank: each experts call sends (E-1)/E of its T*k rows, dispatch and combine, forward and
    backward (recomputation: the forward's two again)."""
    rows = BATCH * SEQ * TOP_K
    return LAYERS * (6 if recompute else 4) * rows * (ep - 1) // ep * HIDDEN * 4


def test_all_to_all_bytes_and_the_receive_buffer():
    w = _plan(2).worlds[4].expert_parallel
    assert w["all_to_all_bytes"] == _a2a_formula(2) and w["all_to_all_calls"] == 4 * LAYERS
    assert w["tokens_per_call"] == BATCH * SEQ and w["top_k"] == TOP_K
    assert w["recv_buffer_bytes"] == BATCH * SEQ * TOP_K * HIDDEN * 4            # uniform: as many rows as sent
    assert w["recv_buffer_worst_bytes"] == 2 * w["recv_buffer_bytes"]            # every row of the group to one rank
    ac = _plan(2, activation_checkpointing=True).worlds[4].expert_parallel
    assert ac["all_to_all_bytes"] == _a2a_formula(2, recompute=True)


def test_experts_are_not_gathered_where_shard_size_equals_ep():
    """At world 2, ep 2 every rank holds its experts whole (efsdp of one rank): no experts collective at all, and
    the plan's all-gathers shrink by at least the experts' bytes (2 gathers of layer 0, 1 of the last layer,
    half of each sent); at world 4 they are gathered over 2 ranks, half the experts: fewer bytes than whole.
    The comparison is the same plan with expert_parallel=None, world by world."""
    ep, base = _plan(2), _plan(None)
    per_layer = sum(p.numel() for m in tiny_qwen3_moe().modules() if hasattr(m, "_is_expert_parallel")
                    for p in m.parameters(recurse=False)) // LAYERS
    w2, b2 = ep.worlds[2], base.worlds[2]
    assert w2.expert_parallel["expert_collective_bytes"] == 0
    assert b2.wire_bytes["all_gather"] - w2.wire_bytes["all_gather"] >= 3 * per_layer * 4 // 2
    w4, b4 = ep.worlds[4].expert_parallel, base.worlds[4]
    assert 0 < w4["expert_collective_bytes"] < w4["expert_collective_bytes_without_ep"]
    for w, b in ((w2.expert_parallel, b2), (w4, b4)):
        assert (w["wire_bytes_without_ep"], w["peak_without_ep"]) == (b.wire_total, b.peak)
        assert w["recommend"] == (w["wire_bytes_with_ep"] < w["wire_bytes_without_ep"]) and w["recommend"]


def test_recommendation_follows_the_bytes():
    """Many tokens per rank and few expert parameters: the all-to-alls move more than gathering the experts."""
    p = fp.plan(tiny_qwen3_moe, world_size=[4], expert_parallel=2, seq_len=512, batch_size=8, device="cpu")
    w = p.worlds[4].expert_parallel
    assert w["wire_bytes_with_ep"] > w["wire_bytes_without_ep"] and not w["recommend"]
    assert w["all_to_all_bytes"] == _a2a_formula(2) * 8 * 512 // (BATCH * SEQ)


def _uniform_router(model):
    """Every token picks expert t % 2 (EP rank 0) and 2 + t % 2 (EP rank 1): each rank sends exactly half its rows."""
    for layer in model.model.layers:
        gate = layer.mlp.gate

        def forward(self, hidden_states):
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            t = torch.arange(logits.shape[0])
            index = torch.stack([t % 2, 2 + t % 2], dim=-1)
            top = torch.softmax(logits, dim=-1).gather(1, index)
            return logits, top.to(logits.dtype), index
        gate.forward = types.MethodType(forward, gate)


def _measured(rank, world, ckpt):
    """Bytes per step of each kind fp.comm_stats counts (steps 1 and 2, after a first step)."""
    torch.manual_seed(0)
    model = tiny_qwen3_moe()
    _uniform_router(model)
    fp.shard(model, expert_parallel=2, activation_checkpointing=ckpt)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    fp.comm_stats.reset()
    for _ in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v // 2 for k, v in fp.comm_stats.bytes.items() if k != "control"}


@pytest.mark.parametrize("world,ckpt", [(2, False), (2, True), (4, False)], ids=["w2", "w2-checkpointed", "w4"])
def test_wire_bytes_equal_a_real_ep_run(world, ckpt):
    """Every kind, to the byte: the dense units' all-gathers and reduce-scatters, the experts' (none at world 2,
    over 2 ranks at world 4), the all-to-alls and their index exchanges (recomputation included)."""
    wire = run_ranks(_measured, world, ckpt, timeout=240)
    assert all(w == wire[0] for w in wire)
    plan = _plan(2, world=[world], activation_checkpointing=ckpt)
    assert plan.worlds[world].wire_bytes == wire[0]
    assert wire[0]["all_to_all"] == _a2a_formula(2, recompute=ckpt)


def _measured_tp(rank, world):
    """dp (world / 2) x tp 2, EP 2 over the dp ranks of each TP coordinate, Qwen3's tp_plan minus its experts
    entries (the recipe of tests/test_experts_tensor_parallel.py): fp.comm_stats per step (the dp dimension's and
    the experts' collectives; TP's own are DTensor's, priced apart in tp_wire_bytes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = tiny_qwen3_moe()
    _uniform_router(model)
    names = {n for n, _ in model.named_modules()}
    plan = {k: v for k, v in model.tp_plan.items() if ".experts" not in k and k.replace("*", "0") in names}
    model = fp.shard(parallelize_hf(model, mesh["tp"], plan), device_mesh=mesh["dp"], expert_parallel=2)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank // 2))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    fp.comm_stats.reset()
    for _ in (1, 2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v // 2 for k, v in fp.comm_stats.bytes.items() if k != "control"}


@pytest.mark.parametrize("world", [4, 8], ids=["dp2xtp2", "dp4xtp2"])
def test_wire_bytes_equal_a_real_ep_tp_run(world):
    """EP 2 x TP 2, to the byte on every rank: the all-to-alls (each TP rank sends its dp rank's rows: the tokens
    its TP group shares), the experts' gathers and reductions (none at dp 2, where each EP rank holds its experts
    whole; over dp / E = 2 ranks at dp 4) and the TP-sharded dense units' dp collectives; tp_plan='auto' drops
    the experts' entries (and the dense-MLP keys this all-sparse model has no module for)."""
    wire = run_ranks(_measured_tp, world, timeout=240)
    plan = _plan(2, world=[world], tp_size=2, tp_plan="auto")
    w = plan.worlds[world]
    assert w.tp_size == 2 and all(got == w.wire_bytes for got in wire), (wire, w.wire_bytes)
    assert wire[0]["all_to_all"] == _a2a_formula(2)
    assert (w.expert_parallel["expert_collective_bytes"] == 0) == (world == 4)
    assert w.expert_parallel["recommend"] == (w.wire_total < w.expert_parallel["wire_bytes_without_ep"])


def test_refusals_are_named():
    with pytest.raises(PlanError, match="does not divide the expert count"):
        _plan(3, world=[3])
    with pytest.raises(PlanError, match="shard group of 2 ranks"):
        _plan(4, world=[2])
    with pytest.raises(PlanError, match="no experts module"):
        fp.plan(lambda: torch.nn.Linear(4, 4), world_size=2, expert_parallel=2, inputs=lambda: torch.zeros(1, 4))
    with pytest.raises(PlanError, match="muon"):
        _plan(2, optimizer="muon")
    with pytest.raises(PlanError, match="context_parallel"):
        _plan(2, context_parallel=2)
    with pytest.raises(PlanError, match="expert_capacity_factor"):
        _plan(2, expert_capacity_factor=1.0)
    # EP x TP is priced (test_wire_bytes_equal_a_real_ep_tp_run) with the experts whole on every TP rank: a plan
    # that splits them is refused, as fp.shard refuses it
    with pytest.raises(PlanError, match=r"tp_plan\['model.layers.\*.mlp.experts.down_proj'\] reaches "
                                        r"model.layers.0.mlp.experts.*stay whole on every TP rank"):
        _plan(2, world=[4], tp_size=2, tp_plan={"model.layers.*.self_attn.o_proj": "rowwise",
                                                "model.layers.*.mlp.experts.down_proj": "rowwise"})
    with pytest.raises(PlanError, match="shard group of 1 ranks at data-parallel world 1"):
        _plan(2, world=[4], tp_size=4, tp_plan="auto")      # dp 1: no EP group of 2

    class PerExpert(torch.nn.Module):      # the older form fp.shard runs (tests/test_experts_per_expert.py)
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(4, 2)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            return sum(e(x) for e in self.experts) + self.gate(x).sum()
    with pytest.raises(PlanError, match="per expert"):
        fp.plan(PerExpert, world_size=2, expert_parallel=2, inputs=lambda: torch.zeros(1, 4))


def test_cli_expert_parallel(tmp_path, capsys):
    from fsdp_plugin.cli import main as cli_main
    tiny_qwen3_moe().config.save_pretrained(tmp_path)
    assert cli_main(["plan", str(tmp_path), "--world", "4", "--expert-parallel", "2", "--seq", "8",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "EP all-to-all / step" in out and "EP moves fewer bytes" in out
    assert cli_main(["plan", str(tmp_path), "--world", "4", "--expert-parallel", "2", "--tp-size", "2", "--seq", "8",
                     "--batch", str(BATCH), "--device", "cpu", "--json"]) == 0      # the model's tp_plan
    import json
    got = json.loads(capsys.readouterr().out)["worlds"]["4"]
    assert got["tp_size"] == 2 and got["expert_parallel"]["all_to_all_bytes"] == _a2a_formula(2)


def test_fit_tries_world_sizes_and_strategies_ep_allows():
    from fsdp_plugin.planner._fit import fit
    got = fit(tiny_qwen3_moe, "1GB", max_world=8, expert_parallel=2, seq_len=SEQ, device="cpu")
    assert got.world_size == 2 and got.sharding_strategy != "no_shard"
    assert got.plan.worlds[2].expert_parallel["size"] == 2
