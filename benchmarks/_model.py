"""GPT-style decoder for the benchmarks: pre-LN blocks, causal attention, GELU MLP, tied LM head.

Initialized inside ``__init__`` from ``torch.manual_seed(seed)`` (every backend builds it the same way, so
all start from identical weights; under ``fp.deferred_init()`` the same ops are recorded and replayed).
No dropout: runs are deterministic.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    vocab: int = 8192
    seq_len: int = 128

    def num_params(self) -> int:  # tied head, biases and LayerNorms included
        d, v = self.d_model, self.vocab
        per_block = 12 * d * d + 13 * d
        return v * d + self.seq_len * d + self.n_layer * per_block + 2 * d

    def as_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """The unit every sharded backend wraps."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
                    p.normal_(0.0, std)
                elif name.endswith("bias"):
                    p.zero_()

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


PRESETS = {
    "tiny": dict(n_layer=2, d_model=64, n_head=2, vocab=512, seq_len=32),
    "small": dict(n_layer=4, d_model=256, n_head=4, vocab=8192, seq_len=128),      # 5.3 M
    "medium": dict(n_layer=12, d_model=768, n_head=12, vocab=32768, seq_len=128),  # 110 M
    # 0.86 B params: fp32 params + grads + AdamW state = 16 B/param = 13.7 GB per replica;
    # two replicas (27.5 GB) do not fit in 24 GiB
    "big": dict(n_layer=18, d_model=1920, n_head=16, vocab=32768, seq_len=64),
}
PRESET_BATCH = {"tiny": 8, "small": 8, "medium": 2, "big": 2}  # global sequences per step
