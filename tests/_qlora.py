"""The tiny QLoRA model of tests/test_qlora.py and of the scripts it launches (``scripts/lightning_qlora.py``).

A random Llama written by ``save_pretrained`` (``write_base``) and loaded by transformers in nf4
(``BitsAndBytesConfig(load_in_4bit=True)``, bitsandbytes runs ``Linear4bit`` on CPU), PEFT LoRA on q/v/down.
One module so that every entry point trains the same model on the same per-rank batches.
"""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH, STEPS, WORLD, LR = 96, 8, 2, 4, 2, 1e-2


def write_base(path: str) -> str:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def quantization(storage: torch.dtype, compute: torch.dtype = torch.float32):
    """4-bit nf4 with packed bytes stored as ``storage``; ``storage=torch.int8``: bitsandbytes 8-bit (LLM.int8)."""
    import transformers as tf

    if storage == torch.int8:
        return tf.BitsAndBytesConfig(load_in_8bit=True)
    return tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                                 bnb_4bit_quant_storage=storage)


def add_lora(model, dora: bool = False):
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, use_dora=dora,
                                                      target_modules=["q_proj", "v_proj", "down_proj"]))


def build(path: str, storage: torch.dtype, lora: bool = True, dora: bool = False,
          compute: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32):
    """``from_pretrained(quantization_config=...)`` (+ LoRA), in train mode as Trainer and Lightning put it."""
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(path, quantization_config=quantization(storage, compute), dtype=dtype)
    return (add_lora(model, dora) if lora else model).train()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def packed(model) -> dict:
    """The quantized weights by name (``Params4bit``, ``quant_state`` beside; 8-bit: ``Int8Params``, ``SCB``)."""
    import bitsandbytes as bnb

    return {n: p for n, p in model.named_parameters() if isinstance(p, (bnb.nn.Params4bit, bnb.nn.Int8Params))}


def packed_facts(model) -> dict:
    """What every recipe test checks on each rank after training: the packed bytes this rank holds, and inside
    ``fp.full_params`` (the gathered weights, as forward sees them) how many weights are ``Params4bit`` with a
    ``quant_state`` and their bytes."""
    import fsdp_plugin as fp

    def nbytes(weights: dict) -> int:
        return sum(p.numel() * p.element_size() for p in weights.values())

    local = nbytes(packed(model))
    with fp.full_params(model, writeback=False):
        full = packed(model)
        kept = sum(getattr(p, "quant_state", None) is not None for p in full.values())
        return {"packed_bytes": local, "full_params4bit": kept, "full_bytes": nbytes(full)}
