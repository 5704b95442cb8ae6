"""Real transformers architectures, as a user starts from a pretrained checkpoint.

Each case: a single-process model from a tiny config (no download, dropout 0) is written by transformers'
own ``save_pretrained`` in several shard files; every rank builds the same model on the meta device
(or under accelerate's ``init_empty_weights()``, or real on rank 0 only), shards it with the default wrap
policy, loads the directory with ``fp.load_pretrained``, trains (different data per rank; per-step loss
equal to the single-process model trained on the global batch within 1e-5), writes ``fp.save_pretrained``
(config included), and a plain ``from_pretrained(dir)`` must read back exactly the trained parameters.

MoE cases route every token to every expert (``num_experts_per_tok`` = number of experts), so each
expert gets tokens on every rank in every step; top-k routing with unused experts: tests/test_hf_moe.py.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import transformers as tf
from _dist import run_ranks
from _parity import make_optimizer

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB, SEQ, BATCH, STEPS = 96, 8, 2, 4
_ATTN = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

ZOO = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, _ATTN),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
             {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, _ATTN),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {**_ATTN, "head_dim": 8}),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {**_ATTN, "head_dim": 8}),
    "bert": (tf.BertConfig, tf.BertForMaskedLM,
             {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}),
    "t5": (tf.T5Config, tf.T5ForConditionalGeneration,
           {"vocab_size": VOCAB, "d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 2, "num_heads": 4,
            "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0}),
    # every token goes to every expert, so each expert gets tokens on every rank in every step
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {**_ATTN, "num_local_experts": 4, "num_experts_per_tok": 4}),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  {**_ATTN, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                   "num_experts_per_tok": 4}),
}


def _build(name, where="real"):
    """The model from its tiny config: "real", "meta" (torch.device('meta')) or "empty" (init_empty_weights)."""
    cfg_cls, model_cls, kwargs = ZOO[name]
    config = cfg_cls(**kwargs)
    if where == "meta":
        ctx = torch.device("meta")
    elif where == "empty":
        from accelerate import init_empty_weights
        ctx = init_empty_weights()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        model = model_cls(config)
    return model.train()


def _batch(name, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name in ("bert", "t5"):
        return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _global_batch(name, step, world):
    parts = [_batch(name, step, r) for r in range(world)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _reference(name, world, optim, path):
    """Write the initial model with transformers, then train it in one process on the global batches."""
    torch.manual_seed(0)
    model = _build(name)
    model.save_pretrained(path, max_shard_size="20KB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3, "want several shard files"
    opt = make_optimizer(optim, model.parameters())
    losses = []
    for s in range(STEPS):
        loss = model(**_global_batch(name, s, world)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, world, name, optim, strategy, mesh, build, src, dst, gather=None):
    torch.manual_seed(1234 + rank)   # values must come from the checkpoint (or rank 0), not the seed
    if build == "rank0":
        model = (ZOO[name][1].from_pretrained(src) if rank == 0 else _build(name, "meta")).train()
    else:
        model = _build(name, build)
    kwargs = {"device_mesh": mesh} if mesh else {}
    # AdamW cases shard with param_init_fn="skip" (the checkpoint fills the zeros), SGD cases with the default
    # (transformers' own init, then overwritten): both must end up with the checkpoint and right buffers.
    init = "skip" if optim == "adamw" and build != "rank0" else None
    fp.shard(model, sharding_strategy=strategy, param_init_fn=init, **kwargs)
    if build != "rank0":
        assert not fp.load_pretrained(model, src)
    opt = make_optimizer(optim, model.parameters())
    losses = []
    for s in range(STEPS):
        loss = model(**_batch(name, s, rank)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    fp.save_pretrained(model, dst, max_shard_size="20KB", gather=gather)
    return losses, fp.full_state_dict(model)


def _check(tmp_path, name, world, optim, strategy="full_shard", mesh=None, build="meta", gather=None):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    want_losses, want_state = _reference(name, world, optim, src)
    results = run_ranks(_worker, world, name, optim, strategy, mesh, build, src, dst, gather, timeout=240)
    for losses, _ in results:
        diffs = [abs(a - b) for a, b in zip(losses, want_losses)]
        assert max(diffs) <= 1e-5, f"{name}: loss drift {max(diffs):.2e}: {losses} vs {want_losses}"
    got = results[0][1]
    for k, v in got.items():
        diff = (v - want_state[k]).abs().max().item()
        assert diff <= 1e-5, f"{name} {k}: trained parameter off by {diff:.2e}"
    back = ZOO[name][1].from_pretrained(dst).state_dict()
    for k, v in got.items():
        assert torch.equal(back[k], v), f"{name} {k}: from_pretrained does not read back what was trained"
    assert os.path.exists(os.path.join(dst, "config.json"))


# world, strategy, mesh and optimizer vary across architectures so that the default selection covers every
# strategy, world 2 and 3, SGD-momentum and AdamW, and each way of building the model, in little time.
FAST = [
    ("llama", 2, "sgd", "full_shard", None, "meta"),
    ("gpt2", 3, "adamw", "shard_grad_op", None, "meta"),
    ("qwen2", 2, "adamw", "no_shard", None, "empty"),
    ("gemma", 2, "sgd", "hybrid_shard", (2, 1), "meta"),
    ("bert", 3, "sgd", "full_shard", None, "meta"),
    ("t5", 2, "adamw", "full_shard", None, "rank0"),
    ("mixtral", 2, "sgd", "full_shard", None, "meta"),
]


@pytest.mark.parametrize("name,world,optim,strategy,mesh,build", FAST, ids=[c[0] for c in FAST])
def test_zoo(tmp_path, name, world, optim, strategy, mesh, build):
    _check(tmp_path, name, world, optim, strategy, mesh, build)


@pytest.mark.parametrize("gather", [None, True])
def test_moe_whole_tensor_conversion(tmp_path, monkeypatch, gather):
    """A conversion whose byte layout we do not know: every source of a group is read whole, converted by
    transformers, and sliced; saving gathers the parameter on rank 0 and converts it back. Forced here on
    Mixtral's fused experts (whose known layout is otherwise read and written by ranges)."""
    from fsdp_plugin.checkpoint.hf import hf_convert
    monkeypatch.setattr(hf_convert, "fused_layout", lambda group, shapes: None)
    _check(tmp_path, "mixtral", 3, "adamw", "full_shard", None, "meta", gather)


def test_moe_ranged_save_without_shared_filesystem(tmp_path):
    """gather=True (no shared filesystem): fused experts still split into per-expert tensors on rank 0."""
    _check(tmp_path, "qwen2_moe", 2, "sgd", "shard_grad_op", None, "meta", True)


SLOW = ([(n, w, o, "full_shard", None, "meta") for n in ZOO for w in (2, 3) for o in ("sgd", "adamw")]
        + [("llama", 3, "adamw", s, None, b) for s in ("shard_grad_op", "no_shard") for b in ("empty", "rank0")]
        + [("mixtral", 4, "adamw", "hybrid_shard", (2, 2), "meta"), ("qwen2_moe", 3, "sgd", "no_shard", None, "rank0"),
           ("t5", 3, "sgd", "shard_grad_op", None, "empty"), ("gpt2", 2, "sgd", "full_shard", None, "rank0")])


@pytest.mark.slow
@pytest.mark.parametrize("name,world,optim,strategy,mesh,build", SLOW,
                         ids=[f"{c[0]}-w{c[1]}-{c[2]}-{c[3]}-{c[5]}" for c in SLOW])
def test_zoo_slow(tmp_path, name, world, optim, strategy, mesh, build):
    _check(tmp_path, name, world, optim, strategy, mesh, build)


@pytest.mark.parametrize("init", [None, "skip"])
def test_meta_init_uses_transformers_rules(init):
    """Built on meta and sharded alone: every buffer (rotary inv_freq, position_ids, embed_scale, ...) equals
    the eagerly built model's, parameters are initialized by the model's own _init_weights (or zero under
    "skip"), and no bookkeeping flag is left behind."""
    for name in ZOO:
        torch.manual_seed(0)
        eager = _build(name)
        model = fp.shard(_build(name, "meta"), param_init_fn=init)
        for n, b in model.named_buffers():
            assert torch.equal(b, eager.get_buffer(n)), f"{name} {n}"
        params = dict(eager.named_parameters())
        for n, v in fp.full_state_dict(model).items():
            if n not in params:
                continue
            if init == "skip":
                assert not v.any(), f"{name} {n}"
            elif v.numel() >= 256:   # same distribution as transformers' own init (not e.g. kaiming)
                ratio = (v.std() / params[n].std()).item()
                assert 0.6 < ratio < 1.6 and abs(v.mean() - params[n].mean()) < 0.05, f"{name} {n}: {ratio}"
        assert not any(hasattr(t, "_is_hf_initialized") for t in model.parameters()), name


def test_load_tolerates_what_transformers_tolerates(tmp_path):
    """Older checkpoints still hold buffers that are non-persistent today (BERT's position_ids): transformers
    ignores them on load, and so does fp.load_pretrained (strict)."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    eager = _build("bert")
    sd = {k: v.clone() for k, v in eager.state_dict().items()}
    sd["bert.embeddings.position_ids"] = torch.arange(32).unsqueeze(0)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = fp.shard(_build("bert", "meta"), param_init_fn="skip")
    assert not fp.load_pretrained(model, tmp_path)
    for k, v in fp.full_state_dict(model).items():
        assert torch.equal(v, eager.state_dict()[k]), k
