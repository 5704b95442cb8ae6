"""`LayerSizes`: the shapes of the transformer layer `calibrate` times, default or read off the planned model.

A kernel's rate depends on its shapes: the calibration's fixed CPU layer (width 256, vocab 8192) ran its
matmuls at 134 GFLOP/s where the medium GPT's (width 768, vocab 32768) ran at ~98 (RESULTS § 35d), so the
planner under-predicted that model's step by 19-45% (§ 35e). `LayerSizes.of(model, example_input)` gives
the calibration the model's own width, heads, vocabulary and micro-batch; `fitted` keeps it in memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .errors import PlanError

# Default layers: CPU like the small models a CPU trains (a replay ~0.1 s at 1 thread), CUDA like a 1-3 B
# model's layer at 4096 tokens (a replay ~10 ms on an A100 in bf16).
SIZES = {"cpu": dict(batch=4, seq=128, width=256, heads=4, vocab=8192),
         "cuda": dict(batch=4, seq=1024, width=2048, heads=16, vocab=32768)}

# The recorded replay keeps every op's inputs and outputs alive, the logits three times over (logits,
# log-softmax, their gradient): bytes of one fp32 logits tensor allowed, and bytes of the workload per layer
# parameter (parameters, gradients, fp32 masters, their gradients, two AdamW moments and the optimizer's
# recorded temporaries: 37-42 B measured at width 768-1536, fp32).
_LOGITS_BUDGET = {"cpu": 256 * 2**20, "cuda": 4 * 2**30}
_STATE_BUDGET = {"cpu": 2 * 2**30, "cuda": 16 * 2**30}
_BYTES_PER_PARAM = 48
_HEAD_NAMES = ("num_attention_heads", "n_head", "num_heads")
_WIDTH_NAMES = ("hidden_size", "n_embd", "d_model")


@dataclass(frozen=True)
class LayerSizes:
    """One transformer layer + vocabulary head as `calibrate` times it: ``batch`` sequences of ``seq``
    tokens, hidden ``width`` (elements), ``heads`` attention heads (``width`` divisible by it), ``vocab``
    output classes."""

    batch: int
    seq: int
    width: int
    heads: int
    vocab: int

    def __post_init__(self) -> None:
        bad = {k: v for k, v in dataclasses.asdict(self).items() if not isinstance(v, int) or v < 1}
        if bad:
            raise PlanError(f"LayerSizes: {bad} must be positive integers")
        if self.width % self.heads:
            raise PlanError(f"LayerSizes: width {self.width} is not divisible by heads {self.heads}; give heads "
                            f"that divide it (e.g. {_dividing_heads(self.width, self.heads)})")

    @classmethod
    def default(cls, device: Optional[torch.device] = None) -> "LayerSizes":
        """The fixed layer of ``device``'s type (CUDA: a 1-3 B model's; anything else: a small CPU model's)."""
        return cls(**SIZES["cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"])

    @classmethod
    def of(cls, model: nn.Module, example_input: Any = None, device: Optional[torch.device] = None) -> "LayerSizes":
        """Sizes read off ``model`` (meta is fine) and one micro-batch ``example_input`` (a ``(batch, seq)``
        integer tensor, or a dict/tuple/list holding one, e.g. ``input_ids``); each field not found is
        `default`'s. width/vocab: the largest ``nn.Embedding`` (else the config's); heads: the config's
        (``num_attention_heads``, ``n_head``, ``num_heads``), a module's ``n_head``/``num_heads``, else
        width // 64."""
        base = cls.default(device)
        width, vocab = _embedding_sizes(model)
        width = width or _config_int(model, _WIDTH_NAMES) or base.width
        vocab = vocab or _config_int(model, ("vocab_size",)) or base.vocab
        heads = _config_int(model, _HEAD_NAMES) or _module_heads(model) or max(1, width // 64)
        if width % heads:                 # an attribute that was not the layer's head count
            heads = _dividing_heads(width, max(1, width // 64))
        ids = _token_ids(example_input)
        batch, seq = (int(ids.shape[0]), int(ids.shape[1])) if ids is not None else (base.batch, base.seq)
        return cls(batch=batch, seq=seq, width=width, heads=heads, vocab=vocab)

    def describe(self) -> str:
        return f"layer batch {self.batch} seq {self.seq} width {self.width} heads {self.heads} vocab {self.vocab}"


def fitted(sizes: LayerSizes, device: torch.device) -> LayerSizes:
    """``sizes`` within ``device``'s memory budgets: batch (then seq, down to 16) halved until the logits fit;
    width or vocab (the larger share of the parameters) halved until the workload's state fits. Rates
    change little past these sizes (the kernels are already large); the shapes timed are in the source."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    s = sizes
    while 4 * s.batch * s.seq * s.vocab > _LOGITS_BUDGET[kind] and (s.batch > 1 or s.seq > 16):
        s = dataclasses.replace(s, batch=s.batch // 2) if s.batch > 1 else dataclasses.replace(s, seq=s.seq // 2)
    while _BYTES_PER_PARAM * _params(s) > _STATE_BUDGET[kind] and max(s.width, s.vocab) > 256:
        if s.vocab > 12 * s.width:
            s = dataclasses.replace(s, vocab=s.vocab // 2)
        else:                             # keep the head dimension: halve the heads with the width
            s = dataclasses.replace(s, width=s.width // 2, heads=_dividing_heads(s.width // 2, max(1, s.heads // 2)))
    return s


def _params(s: LayerSizes) -> int:
    return 12 * s.width * s.width + s.vocab * s.width


def _dividing_heads(width: int, near: int) -> int:
    """The divisor of ``width`` closest to ``near`` from below (1 at worst)."""
    return next(h for h in range(min(near, width), 0, -1) if width % h == 0)


def _embedding_sizes(model: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """(embedding_dim, num_embeddings) of the largest ``nn.Embedding`` (the token embedding), or Nones."""
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embs:
        return None, None
    big = max(embs, key=lambda m: m.num_embeddings * m.embedding_dim)
    return big.embedding_dim, big.num_embeddings


def _config_int(model: nn.Module, names: tuple) -> Optional[int]:
    """The first positive integer among ``names`` on the model's ``config`` (a multimodal HF config: its text
    config's) or ``cfg``."""
    for cfg in (getattr(model, "config", None), getattr(model, "cfg", None)):
        if cfg is None:
            continue
        text = getattr(cfg, "get_text_config", None)
        cfg = text() if callable(text) else cfg
        for name in names:
            v = getattr(cfg, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _module_heads(model: nn.Module) -> Optional[int]:
    """A submodule's ``n_head``/``num_heads`` integer attribute (an attention module's head count)."""
    for m in model.modules():
        for name in ("n_head", "num_heads"):
            v = getattr(m, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _token_ids(batch: Any) -> Optional[torch.Tensor]:
    """The micro-batch's ``(batch, seq)`` integer tensor: ``input_ids`` in a dict, else the first one found."""
    if isinstance(batch, torch.Tensor):
        integer = not (batch.is_floating_point() or batch.is_complex() or batch.dtype is torch.bool)
        return batch if batch.dim() == 2 and integer and batch.numel() > 0 else None
    if isinstance(batch, dict):
        items = ([batch["input_ids"]] if "input_ids" in batch else []) + list(batch.values())
    elif isinstance(batch, (tuple, list)):
        items = list(batch)
    else:
        return None
    return next((t for t in map(_token_ids, items) if t is not None), None)
