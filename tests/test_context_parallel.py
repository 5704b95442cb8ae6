"""Context parallelism (``fp.shard(model, context_parallel=C)``) on real transformers models, vs one process.

Protocol: the same seed builds the same model on every rank and in the reference; every rank of a CP group
passes the SAME full batch (chosen by ``fp.data_parallel_rank``), different data per data-parallel group; the
reference trains one process on the global batch (the data-parallel groups' batches concatenated). At every
one of 4 AdamW steps: the loss each rank got (<= 1e-5: a CP rank returns the whole batch's loss, not its
part's) and every full parameter (<= 1e-5). Sequence lengths are odd (13: padded to 16 at cp 2, 2C chunks).

What would make a case vacuous is asserted on its own: the model really ran split (``out.logits`` holds half
the positions), Mistral's sliding window (5) really changes the loss at this length, the packed documents
really change it, and the padding mask really masks something.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from _dist import run_ranks
from _parity import check_steps, make_optimizer

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB, SEQ, BATCH, STEPS = 96, 13, 2, 4
_BASE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "head_dim": 8}
MODELS = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": 5}),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
    # local (window 4) / global layers, each with its own rotary base
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}),
    # top-2 of 4 experts; no aux loss (output_router_logits off: a product of batch means, not additive over ranks)
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}),
    # attention logit soft-capping, local/global layers; eager: transformers' SDPA path ignores soft-capping
    # (weights at std 0.2 so that logits reach the cap of 0.2: the cap changes the loss by 3e-2)
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"sliding_window": 4, "attn_logit_softcapping": 0.2,
                                                        "initializer_range": 0.2, "attn_implementation": "eager"}),
    # attention sinks (s_aux), local/global layers, MoE; transformers runs it with its eager attention
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
                 "layer_types": ["sliding_attention", "full_attention"]}),
}


def _build(name, **over):
    cfg_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**_BASE, **extra, **over})).train()


def _batch(step, group, kind="plain"):
    """The batch of data-parallel group ``group`` at ``step``: ``plain`` (full rows), ``padded`` (row 1 is
    left-padded: mask 0 and label -100 on its first 4 tokens) or ``packed`` (row 0 holds two documents:
    position_ids restart at 6, no attention_mask, as transformers' padding-free collator makes them, and
    use_cache=False, without which transformers itself does not separate the documents)."""
    g = torch.Generator().manual_seed(100 * step + group)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, :4] = 0
        out["labels"][1, :4] = -100
        out["attention_mask"] = mask
    elif kind == "packed":
        pos = torch.arange(SEQ).repeat(BATCH, 1)
        pos[0, 6:] = torch.arange(SEQ - 6)
        out["position_ids"] = pos
        out["use_cache"] = False      # transformers separates packed documents only without a KV cache
    return out


def _global(step, dp, kind):
    parts = [_batch(step, g, kind) for g in range(dp)]
    first = parts[0]
    return {k: torch.cat([p[k] for p in parts]) if isinstance(v, torch.Tensor) else v for k, v in first.items()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(name, dp, kind, optim="adamw", **over):
    model = _build(name, **over)
    opt = make_optimizer(optim, model.parameters())
    steps = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(**_global(s, dp, kind)).loss
        loss.backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        steps.append((loss.item(), none, _params(model)))
    return steps


class _Wrapper(torch.nn.Module):
    """What Lightning and accelerate shard: a module that holds the transformers model and calls it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **batch):
        return self.inner(**batch)


def _worker(rank, world, name, cp, kind, shard_kwargs, over, optim="adamw"):
    model = _build(name, **over)
    if shard_kwargs.get("wrapped"):
        shard_kwargs = {k: v for k, v in shard_kwargs.items() if k != "wrapped"}
        model = _Wrapper(model)
    fp.shard(model, context_parallel=cp, **shard_kwargs)
    dp, group = fp.data_parallel_size(model), fp.data_parallel_rank(model)
    assert (dp, group) == (world // cp, rank // cp)
    opt = make_optimizer(optim, model.parameters())
    out, kv, a2a, bwd, ring = [], [], [], [], []
    kinds = ("cp_kv_ring", "cp_kv_ring_bwd", "cp_dkv_ring")
    for s in range(STEPS):
        opt.zero_grad()
        gathers, exchanges = fp.comm_stats.calls["cp_kv"], fp.comm_stats.calls["cp_ulysses"]
        regathers = fp.comm_stats.calls["cp_kv_bwd"]
        rotations = [fp.comm_stats.calls[k] for k in kinds]
        result = model(**_batch(s, group, kind))
        assert result.logits.shape[1] == -(-SEQ // (2 * cp)) * 2, "the model did not run on a split sequence"
        result.loss.backward()
        kv.append(fp.comm_stats.calls["cp_kv"] - gathers)
        a2a.append(fp.comm_stats.calls["cp_ulysses"] - exchanges)
        bwd.append(fp.comm_stats.calls["cp_kv_bwd"] - regathers)
        ring.append(tuple(fp.comm_stats.calls[k] - n for k, n in zip(kinds, rotations)))
        none = {n.removeprefix("inner."): p.grad is None for n, p in model.named_parameters()}
        opt.step()
        loss = result.loss.detach().clone()
        torch.distributed.all_reduce(loss)       # every CP rank holds its group's loss: mean over the world = over dp
        full = fp.full_state_dict(model)          # rank 0 only; tied weights appear once in named_parameters
        full = {n.removeprefix("inner."): v for n, v in full.items()}
        out.append((loss.item() / world, none, {n: v for n, v in full.items() if n in none}))
    return out, kv, a2a, bwd, ring


def _run(name, world, cp, kind="plain", shard_kwargs=None, optim="adamw", gathers=None, rings=None, **over):
    """Parity of every step; ``gathers``: the collectives per step on every rank, (K/V all-gathers, Ulysses
    all-to-alls); default: one all-gather per layer (2 layers), or 8 all-to-alls per layer (forward + backward);
    and, all-gather mode, one more K/V all-gather per layer in backward (``cp_kv_bwd``)."""
    want = _reference(name, world // cp, kind, optim, **over)
    got = run_ranks(_worker, world, name, cp, kind, shard_kwargs or {}, over, optim, timeout=240)
    check_steps([steps for steps, *_ in got], want)
    method = (shard_kwargs or {}).get("context_parallel_attention", "allgather")
    ulysses, ringed = method == "ulysses", method == "ring"
    gathers = gathers or ((0, 16) if ulysses else (0, 0) if ringed else (2, 0))
    for _, kv, a2a, bwd, ring in got:
        assert (kv, a2a) == ([gathers[0]] * STEPS, [gathers[1]] * STEPS), (kv, a2a)
        # the tiled all-gather attention keeps no gathered K/V for backward: it gathers them again, once per layer
        assert bwd == [2 if method == "allgather" else 0] * STEPS, bwd
        # ring: C-1 K/V rotations per layer forward, C-1 again in backward, C-1 hops of the dK/dV partial sums
        assert ring == [rings or ((2 * (cp - 1),) * 3 if ringed else (0, 0, 0))] * STEPS, ring


CASES = [("llama", "plain"), ("mistral", "plain"), ("qwen3", "padded"), ("llama", "packed"), ("gemma3", "plain"),
         ("mixtral", "plain"), ("gpt_oss", "padded"), ("gemma2", "padded")]


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_cp2_matches_one_process(name, kind):
    """cp 2 at world 2: GQA (4 query heads, 2 K/V heads, gathered un-repeated), Mistral's sliding window,
    Qwen3 (q/k norms) with a padding mask, packed documents; 4 AdamW steps, loss and weights <= 1e-5."""
    _run(name, 2, 2, kind)


DP_CP = [("adamw", "full_shard", None), ("sgd", "full_shard", None), ("sgd", "hybrid_shard", (2, 2)),
         ("sgd", "no_shard", None), ("sgd", "shard_grad_op", None)]


@pytest.mark.parametrize("optim,strategy,mesh", DP_CP, ids=[f"{o}-{s}" for o, s, _ in DP_CP])
def test_dp2_cp2_world4(optim, strategy, mesh):
    """dp 2 x cp 2: gradients are summed over the CP pair and averaged over the two data-parallel groups, under
    full_shard (parameters over 4 ranks), shard_grad_op, hybrid_shard (2 x 2: the shard group is one CP pair)
    and no_shard.
    SGD too: AdamW is nearly blind to a constant gradient scale (a divisor of 4 instead of 2 could pass)."""
    kwargs = {"sharding_strategy": strategy, **({"device_mesh": mesh} if mesh else {})}
    _run("llama", 4, 2, shard_kwargs=kwargs, optim=optim)


ULYSSES = [("llama", "packed"), ("gemma3", "padded"), ("gpt_oss", "plain"), ("gemma2", "padded")]


@pytest.mark.parametrize("name,kind", ULYSSES, ids=[f"{n}-{k}" for n, k in ULYSSES])
def test_ulysses_cp2_matches_one_process(name, kind):
    """context_parallel_attention='ulysses': q/k/v to (all positions, half the heads) and back, 4 all-to-alls
    per layer; GQA groups stay whole (query heads 0-1 with K/V head 0 on CP rank 0)."""
    _run(name, 2, 2, kind, shard_kwargs={"context_parallel_attention": "ulysses"})


RING = [("llama", "plain"), ("qwen3", "padded"), ("mistral", "plain"), ("llama", "packed"), ("gpt_oss", "padded"),
        ("gemma2", "padded")]


@pytest.mark.parametrize("name,kind", RING, ids=[f"{n}-{k}" for n, k in RING])
def test_ring_cp2_matches_one_process(name, kind):
    """context_parallel_attention='ring': K/V blocks rotate instead of being gathered, dK/dV partial sums
    travel with them back to their owners; GQA, padding, sliding window, packed documents, sinks, soft-capping
    (rows that see nothing: uniform) exact as the all-gather mode."""
    _run(name, 2, 2, kind, shard_kwargs={"context_parallel_attention": "ring"})


def test_ring_cp4_world4():
    """The ring at 4 ranks: 3 rotations per layer and pass, each block's dK/dV summed over 3 hops."""
    _run("mistral", 4, 4, kind="padded", shard_kwargs={"context_parallel_attention": "ring"})


def test_cp4_world4():
    """cp 4: 8 chunks of 2 (13 tokens padded to 16), rank r holds chunks r and 7 - r; Mistral's window of 5."""
    _run("mistral", 4, 4, kind="padded")


AC = [("full", True, 4), ("every_2", fp.Checkpointing(every=2), 3), ("selective", fp.Checkpointing(selective=True), 4)]


@pytest.mark.parametrize("ckpt,gathers", [(c, g) for _, c, g in AC], ids=[i for i, _, _ in AC])
def test_cp2_with_activation_checkpointing(ckpt, gathers):
    """Recompute re-enters the registered attention in backward: its K/V all-gather runs again for every
    recomputed layer (whole-layer recompute: 2 layers -> 4 per step; every second layer: 3). torch's selective
    checkpointing re-runs it too (4): the gather is an autograd Function, not a kernel whose output it keeps."""
    _run("llama", 2, 2, shard_kwargs={"activation_checkpointing": ckpt}, gathers=(gathers, 0))


def test_ring_cp2_with_activation_checkpointing():
    """Whole-layer recompute re-runs the ring forward in backward: 2 layers x 2 forwards of 1 rotation each."""
    _run("llama", 2, 2, shard_kwargs={"activation_checkpointing": True, "context_parallel_attention": "ring"},
         gathers=(0, 0), rings=(4, 2, 2))


def _bf16_worker(rank, world, cp, method="allgather"):
    model = fp.shard(_build("gemma3"), context_parallel=cp, context_parallel_attention=method,
                     mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16))
    opt = make_optimizer("adamw", model.parameters())
    losses = []
    for s in range(3):
        opt.zero_grad()
        loss = model(**_batch(s, 0, "padded")).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_cp2_composes_with_bf16_mixed_precision(method):
    """bf16 compute, fp32 masters: cp 2 stays within bf16 rounding of the same run in one process (observed
    6e-4 over 3 steps; a wrong split or gradient scale moves the loss by 1e-2 or more). The ring sends its dK/dV
    partial sums in bf16, as the all-gather mode's reduce-scatter does."""
    (want,) = run_ranks(_bf16_worker, 1, 1, timeout=120)
    for got in run_ranks(_bf16_worker, 2, 2, method, timeout=120):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 2e-3, (got, want)


def test_cp2_inside_a_wrapper_module():
    """The sharded root holds the transformers model (a LightningModule does): the split hooks its forward."""
    _run("qwen3", 2, 2, shard_kwargs={"wrapped": True})


def test_cases_are_not_vacuous():
    """The sliding windows (Mistral's, Gemma 3's local layer), Gemma 2's soft-capping, gpt-oss's attention
    sinks, the packed documents (same positions, one document: transformers detects packing only without an
    attention_mask) and the left padding each change the one-process loss here."""
    def loss(name, batch, **over):
        with torch.no_grad():
            return _build(name, **over)(**batch).loss.item()
    plain = _batch(0, 0)
    assert abs(loss("mistral", plain) - loss("mistral", plain, sliding_window=None)) > 1e-4
    assert abs(loss("gemma3", plain) - loss("gemma3", plain, sliding_window=SEQ)) > 1e-4
    packed = _batch(0, 0, "packed")
    unpacked = {**packed, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}   # same positions, one document
    assert abs(loss("llama", packed) - loss("llama", unpacked)) > 1e-4
    assert abs(loss("gemma2", plain) - loss("gemma2", plain, attn_logit_softcapping=None)) > 1e-4
    model = _build("gpt_oss")
    with torch.no_grad():
        with_sinks = model(**plain).loss.item()
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e9)       # no mass on the sink: plain softmax
        assert abs(with_sinks - model(**plain).loss.item()) > 1e-4
    padded = _batch(0, 0, "padded")
    assert abs(loss("qwen3", padded) - loss("qwen3", {**padded, "attention_mask": None})) > 1e-4


def _helpers_worker(rank, world):
    """fp.gather_sequence against one process's logits; the named errors of a wrong world and a wrong batch."""
    from fsdp_plugin.errors import ConfigError, UnsupportedError, UsageError
    with pytest.raises(ConfigError, match="does not divide the world"):
        fp.shard(_build("llama"), context_parallel=3)
    with pytest.raises(ConfigError, match="does not divide the shard group"):
        fp.shard(_build("llama"), context_parallel=2, sharding_strategy="hybrid_shard", device_mesh=(2, 1))
    odd = fp.shard(_build("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=1),
                   context_parallel=2, context_parallel_attention="ulysses")
    with pytest.raises(UnsupportedError, match="context_parallel_attention='allgather'"):
        odd(**_batch(0, 0))      # 3 heads over 2 ranks: the error names the mode that can
    batch = _batch(0, 0, "padded")
    with torch.no_grad():
        want = _build("llama")(**batch).logits
    model = fp.shard(_build("llama"), context_parallel=2)
    with torch.no_grad():
        out = model(**batch)
    full = fp.gather_sequence(model, out.logits)
    assert full.shape == want.shape and (full - want).abs().max().item() <= 1e-5
    with pytest.raises(UsageError, match="data_parallel_rank"):
        model(**_batch(0, rank))            # split by the global rank: the CP pair got different batches
    return True


def test_gather_sequence_and_named_errors():
    assert run_ranks(_helpers_worker, 2, timeout=120) == [True, True]


def test_unsplittable_models_are_refused_at_shard():
    """Before any collective or change: a plain module, linear-attention layers (Qwen3-Next), a bad size."""
    from fsdp_plugin.errors import ConfigError
    with pytest.raises(ConfigError, match="PreTrainedModel"):
        fp.shard(torch.nn.Linear(4, 4), context_parallel=2)
    cfg = tf.Qwen3NextConfig(**{**_BASE, "num_key_value_heads": 2})
    with torch.device("meta"):
        model = tf.Qwen3NextForCausalLM(cfg)
    with pytest.raises(ConfigError, match="'linear_attention' layers"):
        fp.shard(model, context_parallel=2)
    with pytest.raises(ConfigError, match="positive int"):
        fp.ShardingConfig(context_parallel=0)
    with pytest.raises(ConfigError, match="context_parallel_attention"):
        fp.ShardingConfig(context_parallel=2, context_parallel_attention="zigzag")
    with pytest.raises(fp.PlanError, match="does not divide world_size"):    # fp.plan prices CP (test_plan_context_parallel)
        fp.plan(lambda: _build("llama"), 3, context_parallel=2)


def _resume_worker(rank, world, path, cp, first, steps):
    """Shard at ``cp`` (1: no CP), load ``path`` unless ``first`` is 0, train ``steps`` steps from step ``first``,
    save to ``path`` + ``_<last step>``."""
    model = fp.shard(_build("llama"), context_parallel=cp)
    opt = make_optimizer("adamw", model.parameters())
    if first:
        fp.load_checkpoint(path, model, opt)
    out = []
    for s in range(first, first + steps):
        opt.zero_grad()
        loss = model(**_batch(s, fp.data_parallel_rank(model))).loss
        loss.backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        full = fp.full_state_dict(model)
        out.append((loss.item(), none, {n: v for n, v in full.items() if n in none}))
    fp.save_checkpoint(f"{path}_{first + steps}", model, opt)
    return out


def test_checkpoint_saved_at_cp2_resumes_without_cp_and_back(tmp_path):
    """Saved at cp 2 (world 2), resumed in one process without CP, saved, resumed at cp 2 again: every step's
    loss and weights stay on the one-process trajectory (CP changes only the checkpoint's shard count)."""
    want = _reference("llama", 1, "plain")
    path = str(tmp_path / "ck")
    first = run_ranks(_resume_worker, 2, path, 2, 0, 2, timeout=120)
    middle = run_ranks(_resume_worker, 1, path + "_2", 1, 2, 1, timeout=120)
    last = run_ranks(_resume_worker, 2, path + "_2_3", 2, 3, 1, timeout=120)
    check_steps([first[0] + middle[0] + last[0], first[1] + [(middle[0][0][0], middle[0][0][1], {})] + last[1]],
                want)


def _join_worker(rank, world, counts):
    """dp 2 x cp 2 under torch's Join, averaging over the active data-parallel groups: group 0 has
    ``counts[0]`` batches, group 1 ``counts[1]``; SGD (linear in the gradient's scale)."""
    from torch.distributed.algorithms.join import Join
    model = fp.shard(_build("llama"), context_parallel=2)
    opt = make_optimizer("sgd", model.parameters())
    group = fp.data_parallel_rank(model)
    with Join([model], divide_by_initial_world_size=False):
        for s in range(counts[group]):
            opt.zero_grad()
            model(**_batch(s, group)).loss.backward()
            opt.step()
    full = fp.full_state_dict(model)
    return {n: v for n, v in full.items() if n in dict(model.named_parameters())}


def test_join_counts_a_cp_group_once():
    """After group 1 runs out, group 0's steps average over the ONE active data-parallel group (its two CP
    ranks count once): one process on the global batch for 2 steps, then on group 0's batch alone."""
    model = _build("llama")
    opt = make_optimizer("sgd", model.parameters())
    for s in range(3):
        opt.zero_grad()
        model(**(_global(s, 2, "plain") if s < 2 else _batch(s, 0))).loss.backward()
        opt.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    got = run_ranks(_join_worker, 4, (3, 2), timeout=180)[0]
    for n, v in want.items():
        assert (got[n] - v).abs().max().item() <= 1e-5, n


@pytest.mark.parametrize("cp,seq", [(2, 1001), (4, 1001), (8, 4093)])
def test_head_tail_layout_balances_causal_work(cp, seq):
    """Every CP rank attends over the same number of visible (query, key) pairs within 1% (contiguous chunks
    would give the last rank 2C-1 times the first's; the padding, on rank 0's tail chunk, is counted as the
    work it is), every real causal pair is seen once, and the layout is a permutation of the padded sequence."""
    from transformers.masking_utils import find_packed_sequence_indices

    from fsdp_plugin._context.split import make_layout
    layouts = [make_layout(None, cp, r, 1, seq, None, None, find_packed_sequence_indices) for r in range(cp)]
    assert sorted(layouts[0].kv_index.tolist()) == list(range(layouts[0].padded))
    masks = [lay.mask(True, None, "cpu")[0, 0] for lay in layouts]
    real = [int(m[lay.q_index < seq].sum()) for m, lay in zip(masks, layouts)]
    assert sum(real) == seq * (seq + 1) // 2             # every real causal pair exactly once
    pairs = [int(m.sum()) for m in masks]                # what each rank computes (padded queries included)
    assert max(pairs) / min(pairs) <= 1.01, pairs
