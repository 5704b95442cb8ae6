"""The only module that talks to torch.distributed collectives; it counts calls and bytes by kind.

Bytes are per rank on a ring: all-gather and reduce-scatter move ``total * (N-1)/N`` elements,
all-reduce ``2 * total * (N-1)/N``, broadcast/scatter ``total * (N-1)/N`` (amortized). A group of one
rank moves nothing and no call is issued.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .errors import CollectiveError


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


def ring_bytes(total_elems: int, elem_size: int, n: int, factor: int = 1) -> int:
    """Per-rank bytes on a ring of ``n`` ranks for a collective over ``total_elems`` elements (the counters'
    formula; fp.plan predicts traffic with it too)."""
    return factor * total_elems * elem_size * (n - 1) // n


def _count(kind: str, total_elems: int, elem_size: int, n: int, factor: int = 1) -> None:
    STATS.calls[kind] += 1
    STATS.bytes[kind] += ring_bytes(total_elems, elem_size, n, factor)


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


def wait(work, what: str = "collective", timeout_s: Optional[float] = None) -> None:
    """Wait for ``work``; a peer that died or diverged becomes a CollectiveError within ``timeout_s``."""
    if work is None:
        return
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s)) if timeout_s else work.wait()
    except RuntimeError as e:
        raise _collective_error(what, timeout_s, e) from e
    if ok is False:
        raise _collective_error(what, timeout_s, None)


def _collective_error(what: str, timeout_s, cause) -> CollectiveError:
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = str(cause).splitlines()[0][:300] if cause else ""
    if cause is None or "timed out" in text.lower() or "timeout" in text.lower():
        return CollectiveError(
            f"rank {rank}: {what} did not complete within {timeout_s:.0f}s. Another rank probably failed, is stuck "
            "or ran different units; check its log. The limit is ShardingConfig(timeout_s=...) or the "
            "FSDP_PLUGIN_TIMEOUT_S environment variable (default 600 s).")
    return CollectiveError(f"rank {rank}: {what} failed ({text}). Another rank probably died or was killed; "
                           "check its log.")


def default_timeout_s(configured: Optional[float]) -> float:
    return float(configured if configured is not None else os.environ.get("FSDP_PLUGIN_TIMEOUT_S", 600))
