"""Real text that ships with every Python: the standard library's own ``.py`` sources, as bytes.

No downloads. Tokens are bytes (vocabulary 256). Batches are drawn by a generator seeded with
``(seed, rank, step)``, so each rank sees different data, and a run resumed at step ``s`` sees exactly
the batches that an uninterrupted run would have seen from step ``s`` on.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB = 256


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Concatenate the stdlib's top-level ``*.py`` files (sorted by name) up to ``max_bytes``; uint8 tensor."""
    chunks: list[bytes] = []
    total = 0
    for path in sorted(stdlib_dir().glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python sources under {stdlib_dir()}")
    buf = bytearray(b"".join(chunks)[:max_bytes])
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def split(corpus: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    n_val = max(int(len(corpus) * val_fraction), 1)
    return corpus[:-n_val], corpus[-n_val:]


def get_batch(data: torch.Tensor, batch: int, seq: int, *, seed: int, rank: int, step: int):
    """``batch`` random windows of ``seq + 1`` bytes; returns (inputs, targets) as int64 [batch, seq]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7_919 + step * 31 + 1)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    windows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
