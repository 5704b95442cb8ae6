"""``model.generate()`` on a sharded model, called as on one GPU, with prompts, ``max_new_tokens`` and EOS that
differ per rank: every rank gets exactly the tokens the unsharded model generates for its own prompt.

Rank 0 stops first (fewer new tokens), rank 1 has the shorter prompt and the most new tokens, and in the EOS
case rank 0's EOS is the token the unsharded model emits at its second step, so it stops early on its own. Every
forward all-gathers the units (``reshard_after_forward``), so without synced stepping the ranks' collectives stop
pairing at rank 0's last step (``_build/generate.py``). Greedy and sampled (same seed per rank as the reference).
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp

tf = pytest.importorskip("transformers")

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB = 96
PROMPTS = {0: [5, 17, 3, 42, 8], 1: [9, 60, 2]}
NEW = {0: 4, 1: 9}


def _model():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return tf.LlamaForCausalLM(cfg).eval()


def _generate(model, rank: int, sample: bool, eos) -> list[int]:
    torch.manual_seed(100 + rank)
    kwargs = {"do_sample": True, "top_k": 0, "temperature": 1.0} if sample else {"do_sample": False}
    out = model.generate(torch.tensor([PROMPTS[rank]]), max_new_tokens=NEW[rank], eos_token_id=eos.get(rank),
                         pad_token_id=0, **kwargs)
    return out[0].tolist()


def _worker(rank, world, sample, eos):
    model = _model()
    fp.shard(model, timeout_s=60)
    return _generate(model, rank, sample, eos)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("early_eos", [False, True], ids=["max_new_tokens", "eos"])
def test_generate_per_rank_lengths_matches_unsharded(sample, early_eos):
    model = _model()
    eos = {}
    if early_eos:     # rank 0 stops at its second new token: the unsharded model's choice there
        eos = {0: _generate(model, 0, sample, {})[len(PROMPTS[0]) + 1]}
    want = [_generate(model, r, sample, eos) for r in range(2)]
    got = run_ranks(_worker, 2, sample, eos, timeout=180)
    assert got == want
    lengths = [len(t) - len(PROMPTS[r]) for r, t in enumerate(want)]
    assert lengths[0] < lengths[1], lengths            # the ranks ran different numbers of decoding steps
    if early_eos:
        assert lengths[0] <= 2 < NEW[0], lengths


def test_synced_gpus_defaults_to_true_and_an_explicit_value_passes():
    from fsdp_plugin._build.generate import _synced

    seen = []
    synced = _synced(lambda *a, **kw: seen.append(kw.get("synced_gpus")))
    synced(1)
    synced(1, synced_gpus=None)
    synced(1, synced_gpus=False)
    assert seen == [True, True, False]
    assert "generate" not in _model().__dict__     # unsharded models keep transformers' own method
