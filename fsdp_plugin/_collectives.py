"""The only module that talks to torch.distributed collectives; it counts calls and bytes by kind.

Bytes are per rank on a ring: all-gather and reduce-scatter move ``total * (N-1)/N`` elements,
all-reduce ``2 * total * (N-1)/N``, broadcast/scatter ``total * (N-1)/N`` (amortized). A group of one
rank moves nothing and no call is issued.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Process-wide counters: ``calls[kind]`` and ``bytes[kind]`` (per-rank ring bytes)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


STATS = CommStats()


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _count(kind: str, total_elems: int, elem_size: int, n: int, factor: int = 1) -> None:
    STATS.calls[kind] += 1
    STATS.bytes[kind] += factor * total_elems * elem_size * (n - 1) // n


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, kind: str = "all_gather"):
    """Gather ``inp`` (one chunk per rank) into ``out`` (``n * inp.numel()`` elements), rank order."""
    n = group_size(group)
    _count(kind, out.numel(), out.element_size(), n)
    return dist.all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """Sum ``inp`` across ranks and keep this rank's chunk in ``out`` (``inp.numel() / n`` elements)."""
    n = group_size(group)
    _count("reduce_scatter", inp.numel(), inp.element_size(), n)
    return dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False, kind: str = "all_reduce"):
    """In-place all-reduce; ``kind="control"`` keeps small bookkeeping out of the training-bytes formula."""
    n = group_size(group)
    _count(kind, t.numel(), t.element_size(), n, factor=2)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group) -> None:
    n = group_size(group)
    _count("broadcast", t.numel(), t.element_size(), n)
    dist.broadcast(t, src=src, group=group)


def scatter(out: torch.Tensor, chunks: Optional[list], src: int, group) -> None:
    """Rank ``src`` sends ``chunks[r]`` to rank r (global rank ``src``)."""
    n = group_size(group)
    _count("scatter", out.numel() * n, out.element_size(), n)
    dist.scatter(out, chunks, src=src, group=group)


def wait(work) -> None:
    if work is not None:
        work.wait()
