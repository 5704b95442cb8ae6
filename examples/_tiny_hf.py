"""Tiny Hugging Face pieces for the examples, built locally (nothing downloaded): a character-level
tokenizer and a small Llama from a config, plus short text samples from the Python standard library."""
from __future__ import annotations

from _text import load_corpus

CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]


def tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (printable ASCII, ``<pad>``, ``<eos>``, ``<unk>``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(vocab_size: int, seed: int = 0):
    """A ~0.2 M parameter Llama (2 decoder layers), random init under ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def text_dataset(samples: int = 256, chars: int = 96):
    """``datasets.Dataset`` of ``{"text": ...}``: consecutive slices of the stdlib's sources."""
    from datasets import Dataset

    raw = bytes(load_corpus(max(samples * chars + 1, 1 << 17))[: samples * chars].tolist()).decode("ascii", errors="replace")
    return Dataset.from_dict({"text": [raw[i * chars:(i + 1) * chars] for i in range(samples)]})
