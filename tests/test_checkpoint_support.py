"""Shared model for the checkpoint tests (no tests here)."""
from __future__ import annotations

import torch
from torch import nn


class TiedNet(nn.Module):
    """Embedding tied to the head, a frozen layer, a persistent and a non-persistent buffer."""

    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.l1 = nn.Linear(d, 7)
        self.frozen = nn.Linear(7, d)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.5))
        self.register_buffer("counts", torch.arange(5))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, idx):
        h = torch.tanh(self.l1(self.emb(idx) * self.scale))
        return self.head(self.frozen(h))
