"""fp.iter_full_params / fp.full_params_meta: full weights streamed unit by unit, bit-exact with one process.

References are computed in one process from the same initial model: ``state_dict()`` (module names),
transformers' own ``save_pretrained`` files (HF names: tied weights once, Mixtral's fused experts split back),
PEFT's ``merge_and_unload`` (merged LoRA) and ``get_peft_model_state_dict`` (adapter-only).
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers as tf
from _dist import run_ranks
from safetensors.torch import load_file

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

_ATTN = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def _llama(tied=True):
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_ATTN, tie_word_embeddings=tied))


def _mixtral():
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(**_ATTN, num_local_experts=4, num_experts_per_tok=2))


def _lora(model):
    import peft
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


BUILD = {"llama": _llama, "llama_untied": lambda: _llama(False), "mixtral": _mixtral,
         "llama_lora": lambda: _lora(_llama())}


def _hf_reference(model, tmp):
    model.save_pretrained(tmp)
    return load_file(os.path.join(tmp, "model.safetensors"))


def _reference(name, names, merge_lora, tmp):
    """The expected {name: tensor} (one process, from the same initial model)."""
    model = BUILD[name]()
    if name.endswith("_lora"):
        from peft.utils import get_peft_model_state_dict
        if not merge_lora:
            sd = get_peft_model_state_dict(model) if names == "hf" else {
                n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
            return dict(sd)
        model = model.merge_and_unload()
    return _hf_reference(model, tmp) if names == "hf" else model.state_dict()


def _stream(rank, world, name, names, ranks, dtype, merge_lora, bucket):
    model = fp.shard(BUILD[name]())
    meta = fp.full_params_meta(model, dtype=dtype, names=names, merge_lora=merge_lora)
    calls = fp.comm_stats.calls["control"]
    got = {}
    for n, t in fp.iter_full_params(model, dtype=dtype, names=names, merge_lora=merge_lora, ranks=ranks,
                                    bucket_bytes=bucket):
        assert n not in got, f"{n} yielded twice"
        got[n] = t.detach().cpu().clone()
    agreements = fp.comm_stats.calls["control"] - calls
    return {"meta": [(n, list(s), str(d)) for n, s, d in meta], "got": got, "agreements": agreements,
            "full": fp.full_state_dict(model) if names == "module" and not name.endswith("_lora") else None}


def _check(tmp_path, name, world, names="hf", ranks=(0,), dtype=None, merge_lora=False, bucket=None):
    out = run_ranks(_stream, world, name, names, ranks, dtype, merge_lora, bucket)
    ref = _reference(name, names, merge_lora, str(tmp_path))
    if dtype is not None:
        ref = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ref.items()}
    asking = range(world) if ranks == "all" else ranks
    for r in range(world):
        got = out[r]["got"]
        if r not in asking:
            assert got == {}
            continue
        assert list(got) == [n for n, _, _ in out[r]["meta"]], "meta order differs from the stream"
        assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
        for n, t in got.items():
            assert t.dtype == ref[n].dtype and torch.equal(t, ref[n]), n
            assert [list(t.shape), str(t.dtype)] == [list(m[1:]) for m in out[r]["meta"] if m[0] == n][0]
        if out[r]["full"] is not None and r == 0:
            assert set(got) == set(out[r]["full"])
            assert all(torch.equal(got[n], out[r]["full"][n]) for n in got)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ranks", [(0,), "all"])
def test_llama_hf_names_match_transformers_save_pretrained(tmp_path, world, ranks):
    _check(tmp_path, "llama", world, "hf", ranks)


@pytest.mark.parametrize("world", [2, 3])
def test_module_names_match_full_state_dict(tmp_path, world):
    out = _check(tmp_path, "llama_untied", world, "module", ranks="all")
    assert out[0]["agreements"] == 2 + 2      # one per round: unsharded leftovers, root unit, 2 layers


def test_dtype_cast_and_buckets(tmp_path):
    out = _check(tmp_path, "llama", 2, "hf", dtype=torch.bfloat16, bucket=1 << 30)
    assert out[1]["agreements"] == 2          # leftovers + every unit in one bucket


def test_mixtral_fused_experts_are_split_like_transformers(tmp_path):
    _check(tmp_path, "mixtral", 2, "hf")


@pytest.mark.parametrize("names", ["hf", "module"])
def test_lora_merged(tmp_path, names):
    _check(tmp_path, "llama_lora", 2, names, merge_lora=True)


@pytest.mark.parametrize("names", ["hf", "module"])
def test_lora_adapter_only(tmp_path, names):
    _check(tmp_path, "llama_lora", 3, names, ranks="all")


def _raising(rank, world, ranks, fail_rank, how):
    model = fp.shard(_llama())
    seen = 0
    try:
        for n, t in fp.iter_full_params(model, ranks=ranks):
            seen += 1
            if rank == fail_rank and seen == 3:
                if how == "break":
                    break
                raise ConnectionResetError("the inference engine closed its socket")
    except ConnectionResetError as e:
        first = f"consumer: {e}"
    except fp.CollectiveError as e:
        first = f"peer: {e}"
    else:
        first = "no error"
    # the ranks are still in step: a collective afterwards works
    sd = fp.full_state_dict(model, rank0_only=False)
    return first, len(sd)


@pytest.mark.parametrize("ranks,fail_rank,how", [((0,), 0, "raise"), ("all", 1, "raise"), ((0,), 0, "break")])
def test_a_failing_consumer_stops_every_rank(ranks, fail_rank, how):
    out = run_ranks(_raising, 3, ranks, fail_rank, how, timeout=60)
    for r, (first, n) in enumerate(out):
        assert n > 0
        if r == fail_rank:
            assert first == ("no error" if how == "break" else "consumer: the inference engine closed its socket")
        else:
            assert first.startswith(f"peer: iter_full_params: rank {fail_rank} stopped while streaming"), first


def test_meta_needs_no_process_group():
    meta = fp.full_params_meta(_llama(), dtype=torch.bfloat16)
    assert ("lm_head.weight" not in [n for n, _, _ in meta]) and meta[0][2] == torch.bfloat16
    with pytest.raises(fp.UsageError, match="names='hf'"):
        fp.full_params_meta(_llama(), names="vllm")


def test_lora_merged_in_the_master_dtype_then_cast(tmp_path):
    _check(tmp_path, "llama_lora", 2, "hf", merge_lora=True, dtype=torch.bfloat16)


def test_mixtral_cast_before_the_gather(tmp_path):
    _check(tmp_path, "mixtral", 3, "hf", ranks="all", dtype=torch.bfloat16)
