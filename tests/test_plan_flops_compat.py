"""fp.plan counts the same FLOPs for the transformers zoo on every supported torch (issue 47, part 5).

torch 2.11's ``sdpa_flop_count`` refuses grouped-query attention (fixed in 2.12), which crashed ``fp.plan`` /
``fsdp-plugin plan`` on every GQA model; `_compat.flop_formulas` swaps in 2.12's formula where the installed one
refuses. Every count here is checked against a hand formula written from the config alone (2 FLOPs per
multiply-add; a linear layer costs 6·tokens·in·out per step: forward, input gradient, weight gradient), so the
same numbers must come out on each torch: run this file under every torch of the CI matrix.
"""
from __future__ import annotations

import json

import pytest
import torch

from fsdp_plugin import _compat
from fsdp_plugin.planner import api

tf = pytest.importorskip("transformers")

import fsdp_plugin as fp  # noqa: E402
from fsdp_plugin.cli import main as cli_main  # noqa: E402

B, S = 2, 8                         # micro-batch of the zoo plans: T = 16 tokens
T = B * S
H, I, HEADS, KV, V, L = 32, 64, 4, 2, 96, 2
D = H // HEADS
_GQA = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=HEADS,
            num_key_value_heads=KV, max_position_embeddings=64)


# ------------------------------------------------------------------ hand formulas
def attn_fused(b, h, s_q, s_k, d_qk, d_v):
    """Forward + backward of one fused attention kernel (flash/efficient/cuDNN/CPU flash): forward q·kᵀ and p·v;
    backward recomputes q·kᵀ, then dP, dV, dQ, dK. Independent of the key/value head count (GQA broadcasts)."""
    forward = 2 * b * h * s_q * s_k * (d_qk + d_v)
    backward = 2 * b * h * s_q * s_k * (3 * d_qk + 2 * d_v)
    return forward + backward


def attn_math(b, h, s_q, s_k, d_qk, d_v):
    """Forward + backward of SDPA's unfused math path (two bmm forward, four backward, nothing recomputed)."""
    return 3 * 2 * b * h * s_q * s_k * (d_qk + d_v)


def linear(tokens, *in_out_pairs):
    return sum(6 * tokens * i * o for i, o in in_out_pairs)


def gqa_attention_projections(h=H, heads=HEADS, kv=KV, d=D):
    return [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h)]


def dense_llama(tokens=T, vocab=V, h=H, inter=I, layers=L):
    per_layer = linear(tokens, *gqa_attention_projections(h), (h, inter), (h, inter), (inter, h))
    return layers * per_layer + linear(tokens, (h, vocab))


# ------------------------------------------------------------------ the formulas themselves
SHAPES = [   # (b, h_q, h_kv, s_q, s_k, d_qk, d_v)
    (2, 4, 2, 8, 8, 8, 8),       # GQA
    (1, 8, 1, 5, 7, 16, 16),     # MQA, cross lengths
    (2, 4, 4, 3, 3, 12, 6),      # MHA with MLA's unequal head dims
    (3, 6, 3, 4, 9, 8, 4),       # GQA, unequal lengths and head dims
]


@pytest.mark.parametrize("b,h_q,h_kv,s_q,s_k,d_qk,d_v", SHAPES)
def test_sdpa_formulas_equal_the_hand_formula(b, h_q, h_kv, s_q, s_k, d_qk, d_v):
    q, k, v, g = (b, h_q, s_q, d_qk), (b, h_kv, s_k, d_qk), (b, h_kv, s_k, d_v), (b, h_q, s_q, d_v)
    forward = 2 * b * h_q * s_q * s_k * (d_qk + d_v)
    assert _compat.sdpa_flop_count(q, k, v) == forward
    assert forward + _compat.sdpa_backward_flop_count(g, q, k, v) == attn_fused(b, h_q, s_q, s_k, d_qk, d_v)
    # the registry the planner prices ops with: every fused SDPA op, on tensors as the dispatcher hands them
    formulas = _compat.flop_formulas()
    t = {n: torch.empty(shape, device="meta") for n, shape in zip("qkvg", (q, k, v, g))}
    aten = torch.ops.aten
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        assert formulas[getattr(aten, name)](t["q"], t["k"], t["v"]) == forward, name
        assert formulas[getattr(aten, name + "_backward")](t["g"], t["q"], t["k"], t["v"]) == \
            attn_fused(b, h_q, s_q, s_k, d_qk, d_v) - forward, name
    # where torch's own formula counts GQA (2.12+), it agrees term for term
    from torch.utils import flop_counter
    try:
        stock = flop_counter.sdpa_flop_count(q, k, v), flop_counter.sdpa_backward_flop_count(g, q, k, v)
    except AssertionError:
        stock = None
        assert h_q != h_kv and not _compat.stock_sdpa_counts_gqa()
    if stock is not None:
        assert stock == (forward, attn_fused(b, h_q, s_q, s_k, d_qk, d_v) - forward)


def test_the_probe_replaces_only_formulas_that_refuse_gqa():
    from torch.utils.flop_counter import flop_registry
    ours = _compat.flop_formulas()
    replaced = {op.__name__ for op in flop_registry if ours[op] is not flop_registry[op]}
    assert replaced <= {p + s for p in _compat._SDPA_OPS for s in ("", "_backward")}
    assert bool(replaced) != _compat.stock_sdpa_counts_gqa()
    try:
        flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]((1, 4, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8))
        refuses = False
    except AssertionError:          # torch 2.11: "query/key/value shapes are incompatible"
        refuses = True
    assert refuses == bool(replaced)
    ours[torch.ops.aten.mm] = None                  # a copy: the planner's table is not touched
    assert _compat.flop_formulas()[torch.ops.aten.mm] is flop_registry[torch.ops.aten.mm]


# ------------------------------------------------------------------ fp.plan of the zoo
def _deepseek_v3():
    return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=I, moe_intermediate_size=16, num_hidden_layers=L,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        n_shared_experts=1, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64))


def _deepseek_v3_flops():
    """MLA (q and kv low-rank, d_qk = 8 + 4 ≠ d_v = 6: CPU SDPA takes the math path, so no fused kernel) +
    layer 0 dense, layer 1 MoE (router, one shared expert, 2 of 4 routed experts per token)."""
    heads, d_qk, d_v, moe = HEADS, 12, 6, 16
    mla = [(H, 16), (16, heads * d_qk), (H, 16 + 4), (16, heads * (8 + d_v)), (heads * d_v, H)]
    swiglu = lambda inter: [(H, inter), (H, inter), (inter, H)]          # noqa: E731
    dense = linear(T, *mla, *swiglu(I))
    sparse = linear(T, *mla, (H, 4), *swiglu(moe)) + linear(T * 2, *swiglu(moe))
    attention = L * attn_math(B, heads, S, S, d_qk, d_v)
    return dense + sparse + linear(T, (H, V)) + attention, 0          # (total, fused attention)


def _moe_flops(per_layer_dense, expert_pairs, k=2):
    attention = L * attn_fused(B, HEADS, S, S, D, D)
    return (L * (linear(T, *per_layer_dense) + linear(T * k, *expert_pairs)) + linear(T, (H, V)) + attention,
            attention)


IMAGE, VLM_SEQ = 63, 10


def _llava():
    vision = tf.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=8, patch_size=4)
    text = tf.LlamaConfig(**{**_GQA, "vocab_size": 64, "max_position_embeddings": 32})
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE, image_seq_length=4,
        vision_feature_layer=-1, vision_feature_select_strategy="default"))


def _llava_inputs():
    ids = torch.randint(0, IMAGE, (B, VLM_SEQ))
    ids[:, 1:5] = IMAGE                            # 2x2 patches of an 8x8 image: four image tokens
    return {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.randn(B, 3, 8, 8)}


def _llava_flops():
    """CLIP tower (per image: 4 patches + CLS, 2 heads of 8, MHA) + projector on the 4 patch features + GQA Llama
    over 10 tokens; the patch convolution's forward and weight gradient (pixels need no gradient)."""
    text_t, vis_t, feat_t = B * VLM_SEQ, B * 5, B * 4
    text = dense_llama(tokens=text_t, vocab=64) + L * attn_fused(B, HEADS, VLM_SEQ, VLM_SEQ, D, D)
    tower = 2 * (linear(vis_t, *[(16, 16)] * 4, (16, 32), (32, 16)) + attn_fused(B, 2, 5, 5, 8, 8))
    conv = 2 * (2 * (B * 16 * 2 * 2) * (3 * 4 * 4))
    projector = linear(feat_t, (16, 32), (32, 32))
    return text + tower + conv + projector, L * attn_fused(B, HEADS, VLM_SEQ, VLM_SEQ, D, D) + 2 * attn_fused(
        B, 2, 5, 5, 8, 8)


ZOO = {   # name: (factory, inputs or None, () -> (total FLOPs, fused-attention FLOPs))
    "llama_gqa": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_GQA)), None,
                  lambda: (dense_llama() + L * attn_fused(B, HEADS, S, S, D, D), L * attn_fused(B, HEADS, S, S, D, D))),
    "qwen2_gqa": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_GQA)), None,
                  lambda: (dense_llama() + L * attn_fused(B, HEADS, S, S, D, D), L * attn_fused(B, HEADS, S, S, D, D))),
    "mixtral_moe": (lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**_GQA, num_local_experts=4,
                                                                  num_experts_per_tok=2)), None,
                    lambda: _moe_flops([*gqa_attention_projections(), (H, 4)], [(H, I), (H, I), (I, H)])),
    "qwen2_moe": (lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
                      **_GQA, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2)), None,
                  lambda: _moe_flops([*gqa_attention_projections(), (H, 4), (H, 32), (H, 32), (32, H), (H, 1)],
                                     [(H, 32), (H, 32), (32, H)])),
    "deepseek_v3_mla": (_deepseek_v3, None, _deepseek_v3_flops),
    "llava_vlm": (_llava, _llava_inputs, _llava_flops),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_plan_of_the_zoo_counts_the_hand_formula(monkeypatch, name):
    factory, inputs, expected = ZOO[name]
    timelines = []
    real_run = api.run
    monkeypatch.setattr(api, "run", lambda *a, **k: timelines.append(real_run(*a, **k)) or timelines[-1])
    kw = {"inputs": inputs} if inputs else {"batch_size": B, "seq_len": S}
    torch.manual_seed(0)
    plan = fp.plan(factory, world_size=[1, 2], device="cpu", **kw)
    total, fused_attention = expected()
    assert (plan.flops_per_step, timelines[0].attention_flops) == (total, fused_attention)
    assert plan.peak_bytes[1] > plan.peak_bytes[2]


def test_cli_plans_a_gqa_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **_GQA}))
    assert cli_main(["plan", str(tmp_path), "--world", "1", "2", "--batch", str(B), "--seq", str(S),
                     "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flops_per_step"] == dense_llama() + L * attn_fused(B, HEADS, S, S, D, D)
    assert out["peak_bytes"]["1"] > out["peak_bytes"]["2"]


def _backward_in_a_forked_child(rank, world):
    z = torch.randn(4, requires_grad=True)
    (z * 2).sum().backward()
    return float(z.grad.sum())


def test_a_forked_child_can_run_backward_after_a_plan():
    """torch 2.11 starts autograd device threads at a first backward on fake tensors, after which every fork-based
    child's backward fails: the planner starts the engine with a real CPU backward first."""
    from _dist import run_ranks
    fp.plan(ZOO["llama_gqa"][0], world_size=2, batch_size=B, seq_len=S, device="cpu")
    assert run_ranks(_backward_in_a_forked_child, 2, timeout=120) == [8.0, 8.0]
