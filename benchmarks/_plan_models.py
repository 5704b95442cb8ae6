"""Models of the planner-accuracy benchmark: the GPT presets and two tiny Hugging Face causal LMs.

Each entry builds the model (eager, or on meta when the planner calls it), one micro-batch per rank, and the
wrap policy both fp.shard and fp.plan get (None: the default, HF ``_no_split_modules``).
"""
from __future__ import annotations

import torch

from _model import GPT, PRESETS, Block, GPTConfig

HF = {
    "hf-llama": ("LlamaConfig", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=8192,
                                     max_position_embeddings=256, tie_word_embeddings=False)),
    "hf-gpt2": ("GPT2Config", dict(n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=256,
                                   attn_implementation="sdpa")),
}
MODELS = ("gpt-small", "gpt-medium", *HF)
SEQ = {"gpt-small": 128, "gpt-medium": 128, "hf-llama": 128, "hf-gpt2": 128}
BATCH = {"gpt-small": 4, "gpt-medium": 1, "hf-llama": 4, "hf-gpt2": 4}   # sequences per rank


def build(name: str):
    if name.startswith("gpt-"):
        return GPT(GPTConfig(**PRESETS[name[4:]]))
    import transformers
    cls_name, kw = HF[name]
    kw = dict(kw)
    attn = kw.pop("attn_implementation", "sdpa")
    config = getattr(transformers, cls_name)(**kw, use_cache=False)   # training: no KV cache (AC recompute)
    config._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(config)


def vocab(name: str) -> int:
    return PRESETS[name[4:]]["vocab"] if name.startswith("gpt-") else HF[name][1].get("vocab_size")


def inputs(name: str, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab(name), (batch, seq + 1), generator=g)
    if name.startswith("gpt-"):
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}


def call(model, batch):
    out = model(**batch) if isinstance(batch, dict) else model(*batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def wrap_policy(name: str):
    return {Block} if name.startswith("gpt-") else None
