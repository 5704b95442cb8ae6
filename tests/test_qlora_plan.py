"""``fp.plan`` of a 4-bit QLoRA base: a skeleton built under ``fp.deferred_init()`` (not quantized yet) and the
same model from ``from_pretrained(quantization_config=...)``.

What must hold: the plan runs (bitsandbytes' own forward cannot run on fake tensors, and asserts "quantization
state not initialized" on a deferred skeleton); its parameter shard bytes per rank are exactly the bytes fp.shard
holds (packed 4-bit bytes in their storage dtype, not the full-precision values the skeleton records); the
``quant_state`` every rank holds whole is counted, computed for a pending weight exactly as bitsandbytes builds
it; the deferred skeleton and the loaded model get the same plan; planning leaves the skeleton to shard and load;
an 8-bit base is refused by name.
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _qlora import WORLD, add_lora, write_base

import fsdp_plugin as fp
from fsdp_plugin._flat import packed_quantize
from fsdp_plugin.planner import _quantized
from fsdp_plugin.planner._units import buffer_bytes

bnb = pytest.importorskip("bitsandbytes")
tf = pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return write_base(str(tmp_path_factory.mktemp("tiny_llama")))


def _quant():
    """README's recipe: nf4, double quantization, bf16 storage (the packed bytes are a floating dtype)."""
    return tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)


def _skeleton(path: str):
    with fp.deferred_init():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        model = tf.integrations.replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                                                        quantization_config=_quant())
        model = add_lora(model.to(torch.bfloat16))
    return model.train()


def _plan(model):
    return fp.plan(model, WORLD, batch_size=2, seq_len=8).worlds[WORLD]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
def test_quant_state_bytes_of_a_pending_weight_equal_bitsandbytes(quant_type, double):
    shape = (40, 70)     # a partial last block; 44 blocks of 64 (double quantization: one block of 256)
    p = bnb.nn.Params4bit(torch.randn(shape), requires_grad=False, blocksize=64, compress_statistics=double,
                          quant_type=quant_type)
    predicted = packed_quantize.state_bytes(p)      # no quant_state yet: from the settings
    assert p.quant_state is None
    p = p.to("cpu")
    real = [p.quant_state.absmax, p.quant_state.code]
    if double:
        real += [p.quant_state.offset, p.quant_state.state2.absmax, p.quant_state.state2.code]
    assert predicted == sum(t.numel() * t.element_size() for t in real) == packed_quantize.state_bytes(p)


def _worker(rank, world, path):
    model = _skeleton(path)
    plan = _plan(model)       # before fp.shard: the weights are pending (full-precision shape, on meta)
    planned_state = _quantized.state_bytes(model)
    fp.shard(model)
    assert not fp.load_pretrained(model, path)    # planning left the skeleton as it was
    shards = sum(h.flat_shard.numel() * h.flat_shard.element_size() for u in model._fp_root.units for h in u.handles)
    return (plan.param_shards, plan.buffers - buffer_bytes(model), planned_state, _quantized.state_bytes(model),
            shards, plan.unsharded_params)


def test_plan_of_a_deferred_4bit_skeleton_counts_what_fp_shard_holds(base_dir):
    got = run_ranks(_worker, WORLD, base_dir, timeout=240)
    eager = add_lora(tf.LlamaForCausalLM.from_pretrained(base_dir, quantization_config=_quant(),
                                                         dtype=torch.bfloat16)).train()
    want = _plan(eager)
    for plan_shards, plan_state, planned_state, real_state, shards, unsharded in got:
        assert plan_shards == shards, (plan_shards, shards)     # packed bf16 bytes + LoRA + the rest, per rank
        assert plan_state == planned_state == real_state == _quantized.state_bytes(eager) > 0
        # the loaded model's plan agrees (its rotary buffers and their activations are fp32: not compared)
        assert (plan_shards, unsharded) == (want.param_shards, want.unsharded_params)
    # the check can fail: the skeleton's pending weights counted as their recorded values would be ~4x the bytes
    skeleton = _skeleton(base_dir)
    recorded = sum(p.numel() * p.element_size() for m in _quantized.layers(skeleton) for p in [m.weight])
    assert recorded >= 3 * sum(m.weight.numel() * m.weight.element_size() for m in _quantized.layers(eager))


def test_plan_of_an_8bit_base_refused_by_name(base_dir):
    """8-bit layers are not modelled (their forward reads ``weight.CB`` a fake run has not got: it failed with an
    AttributeError on a FakeTensor): refused naming the layer, not planned wrong."""
    model = add_lora(tf.LlamaForCausalLM.from_pretrained(base_dir, quantization_config=tf.BitsAndBytesConfig(
        load_in_8bit=True))).train()
    with pytest.raises(fp.PlanError) as err:
        _plan(model)
    assert "bitsandbytes 8-bit layers" in str(err.value) and "layers.0.self_attn.q_proj.base_layer" in str(err.value)
