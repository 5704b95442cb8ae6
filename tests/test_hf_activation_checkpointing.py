"""Hugging Face ``gradient_checkpointing_enable()`` (and checkpointing of modules that are not units) on a
sharded model: the recomputation in backward must see parameters connected to autograd, so the gradients,
and one SGD step, equal the unsharded model's."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp

pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _step(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _ranks(rank, world, wrap_layers):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    ids = torch.arange(64).reshape(4, 16) % 64  # same batch on every rank: averaged grads = local grads
    model = _llama()
    model.gradient_checkpointing_enable()
    fp.shard(model, auto_wrap_policy={LlamaDecoderLayer} if wrap_layers else (lambda m: False))
    _step(model, ids)
    return {k: v.clone() for k, v in fp.full_state_dict(model).items()}


@pytest.mark.parametrize("wrap_layers", [True, False], ids=["unit-per-layer", "root-unit-only"])
def test_hf_gradient_checkpointing_matches_unsharded(wrap_layers):
    got = run_ranks(_ranks, 2, wrap_layers)[0]
    ref = _llama()
    ref.gradient_checkpointing_enable()
    _step(ref, torch.arange(64).reshape(4, 16) % 64)
    want = ref.state_dict()
    assert sorted(got) == sorted(want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
