"""Quantized unit collectives (ZeRO++ qwZ / qgZ), opt-in through ``ShardingConfig(quantization=fp.Quantization())``.

Format (one row per destination or source rank): ``[int8 codes, nb·block | float32 scales, nb]`` as one int8
tensor of ``payload_elems(L, block)`` elements per row of ``L`` values, ``nb = ceil(L / block)`` (the last block
is zero-padded). Symmetric: ``scale = absmax(block) / 127``; weights round to nearest, ``code = round(x / scale)``,
so ``|dequantized − x| ≤ scale / 2`` per element (up to float32 rounding of ``code·scale``); gradients round
stochastically (``< scale``, unbiased). Codes and scales travel
in ONE collective per call: a unit collective has one pairing check (gate), as the exact ones do.

- weights (qwZ): every rank quantizes its exact master shard, the int8 rows are all-gathered (kind
  ``all_gather_q8``) and every rank dequantizes all rows, its own included, into the unsharded buffer: every
  rank's gathered copy is the same, each weight within its block's ``scale/2`` of the master.
- gradients (qgZ): a reduce-scatter is an exchange (all-to-all) of quantized chunks (kind ``reduce_q8``); the
  receiver sums its own exact chunk and the peers' dequantized ones in float32. Gradients round stochastically
  (unbiased: round-to-nearest zeroes every gradient below half a step on every step, a bias Adam amplifies;
  measured in RESULTS § 35q): error < Σ over the other ranks of their block scale. An all-reduce (no_shard,
  hybrid's replica hop) is that exchange followed by an all-gather of the re-quantized float32 sums (error
  adds the sum's own block scale), so replicas agree; between two replicas it is one all-gather of both
  quantized tensors instead, summed dequantized on both (``_pair_all_reduce``: nothing posted at ``wait``).

The returned works dequantize inside ``wait`` (`_Then`): the handle waits on them exactly as on exact ones.
Bytes are counted by ``collectives`` with the ring formula over the int8 payload, which is exactly what each
rank sends (scales included); ``fp.plan`` prices the same payload (``payload_elems``).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import collectives as comm
from . import nodes

WEIGHTS_KIND = "all_gather_q8"
GRADIENTS_KIND = "reduce_q8"
_QMAX = 127.0
_TINY = torch.finfo(torch.float32).tiny     # an all-zero block divides by this (codes 0), its stored scale is 0


def blocks(length: int, block: int) -> int:
    """Blocks (one scale each) of a row of ``length`` values."""
    return -(-length // block)


def payload_elems(length: int, block: int) -> int:
    """int8 elements (= bytes) of one quantized row of ``length`` values: codes, then float32 scales."""
    nb = blocks(length, block)
    return nb * block + 4 * nb


def quantize(rows: torch.Tensor, block: int, stochastic: bool = False) -> torch.Tensor:
    """``rows`` (R, L) of any float dtype -> (R, payload_elems(L, block)) int8 rows (see module docstring).
    ``stochastic``: round up with probability frac(x / scale) (unbiased: E[code·scale] = x; error < scale),
    from this process's own noise (`_add_noise`: the user's RNG streams are untouched); else to nearest."""
    r, length = rows.shape
    nb = blocks(length, block)
    x = rows.float()
    if nb * block != length:
        x = F.pad(x, (0, nb * block - length))
    x = x.view(r, nb, block)
    # absmax as max(amax, -amin): two reads, no |x| temporary of the whole row
    scale = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()).div_(_QMAX)   # (R, nb); 0: all-zero block
    codes = torch.div(x, scale.clamp_min(_TINY).unsqueeze(-1))
    if stochastic:
        _add_noise(codes.view(-1))
        codes = codes.floor_().clamp_(-_QMAX, _QMAX)               # x/scale may exceed 127 by a rounding
    else:
        codes = codes.round_()     # |x / scale| <= 127 by construction (up to float rounding, far from 127.5)
    out = torch.empty((r, payload_elems(length, block)), dtype=torch.int8, device=rows.device)
    out[:, :nb * block].copy_(codes.view(r, nb * block))
    _scales(out, length, block).copy_(scale)
    return out


_SEED_BASE = 0x5EED0000     # + the global rank (benchmarks/quantized_gpt.py --noise-seed shifts it)
_GENERATORS: dict = {}


def _add_noise(flat: torch.Tensor) -> None:
    """Add to ``flat`` a uniform [0, 1) noise per element, for stochastic rounding (floor(x + u)), from this
    process's own generator (`_generator`). ``torch.rand`` per element (~3 ns on one CPU thread): cheaper
    table-based noise (two random offsets into a permuted grid, 1.1 ns) was tried and trained the demo GPT
    within the same 1% on the final loss but with a wider held-out spread over noise seeds (RESULTS § 35c), so
    the exact generator stays."""
    flat.add_(torch.rand(flat.shape, generator=_generator(flat.device), device=flat.device))


def _generator(device: torch.device) -> torch.Generator:
    """The stochastic-rounding generator of ``device``: seeded by the global rank (ranks round independently,
    runs repeat), apart from torch's default generators (dropout and the user's sampling do not shift)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    key = (device, rank, os.getpid())         # a forked process starts its own stream
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device).manual_seed(_SEED_BASE + rank)
    return _GENERATORS[key]


def dequantize(payload: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """(R, payload) int8 rows -> (R, L) float32 values."""
    r, nb = payload.shape[0], blocks(length, block)
    codes = payload[:, :nb * block].view(r, nb, block)
    return (codes.float() * _scales(payload, length, block).unsqueeze(-1)).view(r, nb * block)[:, :length]


def scales(payload: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """The (R, nb) float32 block scales of quantized rows (a view)."""
    return _scales(payload, length, block)


def _scales(payload: torch.Tensor, length: int, block: int) -> torch.Tensor:
    # block % 8 == 0 keeps every row's scale bytes 4-aligned, so the int8 bytes can be viewed as float32
    return payload[:, blocks(length, block) * block:].view(torch.float32)


class _Then:
    """A work whose ``wait`` waits ``work`` and then runs ``then`` once (dequantize, sum): waited like a torch
    Work by ``collectives.wait`` (its ``fp_op`` is the inner collective's record, for deadline reports)."""

    def __init__(self, work, then: Callable[[], None]):
        self.work, self.then = work, then

    @property
    def fp_op(self):
        return getattr(self.work, "fp_op", None)

    @fp_op.setter
    def fp_op(self, op) -> None:
        self.work.fp_op = op

    def wait(self, timeout=None) -> bool:
        if self.then is None:
            return True
        ok = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if ok is False:
            return False
        then, self.then = self.then, None
        then()
        return True


def _waited(work, what: str, timeout_s: Optional[float]) -> None:
    comm.wait(work, what, comm.default_timeout_s(timeout_s))


def applies(quant, what: str, group) -> bool:
    """``quant`` quantizes this ``what`` ("weights" / "gradients") collective over ``group``. Not when the job
    spans nodes (``LOCAL_WORLD_SIZE`` < world) and every rank of ``group`` is on this rank's node (hybrid's shard
    group, hpZ's secondary): those bytes never reach the slow link, so quantizing them would cost compute and
    precision for nothing. On one node everything asked for is quantized. The same answer on every rank of
    ``group`` (a group is inside one node for all its members or for none)."""
    if quant is None or getattr(quant, what) is None:
        return False
    per_node = nodes.node_size()
    if per_node <= 0 or not torch.distributed.is_initialized() or per_node >= torch.distributed.get_world_size():
        return True
    return nodes.peer_split(group)[1] > 0


# ------------------------------------------------------------------ weights
def all_gather(quant, out: torch.Tensor, src: torch.Tensor, group, gate=None, what: str = "all-gather"):
    """Unit all-gather of ``src`` (this rank's shard) into ``out``: exact (``comm.all_gather``) unless
    ``quant.weights`` applies (`applies`); then int8 rows all-gathered and dequantized into ``out`` when
    waited. Async."""
    if not applies(quant, "weights", group):
        return comm.all_gather(out, src, group, async_op=True, gate=gate, what=what)
    n, length, block = comm.group_size(group), src.numel(), quant.block_size
    mine = quantize(src.view(1, length), block)
    staging = torch.empty((n, mine.shape[1]), dtype=torch.int8, device=src.device)
    work = comm.all_gather(staging.view(-1), mine.view(-1), group, async_op=True, kind=WEIGHTS_KIND, gate=gate,
                           what=what)

    def then() -> None:
        out.view(n, length).copy_(dequantize(staging, length, block))
    return _Then(work, then)


# ------------------------------------------------------------------ gradients
def reduce_scatter(quant, out: torch.Tensor, grad: torch.Tensor, group, gate=None, what: str = "reduce-scatter"):
    """Unit reduce-scatter of ``grad`` into ``out`` (this rank's chunk): exact unless ``quant.gradients``;
    then (where it `applies`) an exchange of int8 chunks, summed in float32 with this rank's exact chunk when
    waited. Async."""
    if not applies(quant, "gradients", group):
        return comm.reduce_scatter(out, grad, group, async_op=True, gate=gate, what=what)
    n = comm.group_size(group)
    me = comm.rank_in(group)
    rows = grad.view(n, -1)
    length, block = rows.shape[1], quant.block_size
    sent = quantize(rows, block, stochastic=True)
    got = torch.empty_like(sent)
    work = comm.exchange(got, sent, group, kind=GRADIENTS_KIND, gate=gate, what=what)

    def then() -> None:
        out.copy_(_sum_rows(got, rows[me], me, length, block))
    return _Then(work, then)


def _sum_rows(got: torch.Tensor, own: torch.Tensor, me: int, length: int, block: int) -> torch.Tensor:
    """float32 sum, in rank order, of ``own`` (exact) and the other rows of ``got`` dequantized."""
    total = torch.zeros(length, dtype=torch.float32, device=own.device)
    for j in range(got.shape[0]):
        total.add_(own.float() if j == me else dequantize(got[j:j + 1], length, block)[0])
    return total


def all_reduce(quant, t: torch.Tensor, group, gate=None, what: str = "all-reduce",
               timeout_s: Optional[float] = None):
    """Unit all-reduce of ``t`` in place: exact unless ``quant.gradients``; then a quantized reduce-scatter of
    ``t`` padded to the group (``reduce_scatter``, float32 sums) and, when waited, an all-gather of the
    re-quantized sums dequantized into ``t`` on every rank (the same values on every replica). Async."""
    if not applies(quant, "gradients", group):
        # as before this module: the gated call (no_shard) names itself and blocks with a deadline, the ungated
        # replica hop of hybrid stays asynchronous (waited by the caller)
        named = {"what": what, "timeout_s": timeout_s} if gate is not None else {}
        return comm.all_reduce(t, group, async_op=True, gate=gate, **named)
    n, total, block = comm.group_size(group), t.numel(), quant.block_size
    if n == 2:
        return _pair_all_reduce(t, group, block, gate, what)
    length = -(-total // n)
    padded = t.reshape(-1) if length * n == total else F.pad(t.reshape(-1), (0, length * n - total))
    mine = torch.empty(length, dtype=torch.float32, device=t.device)
    first = reduce_scatter(quant, mine, padded, group, gate=gate, what=what)

    def then() -> None:
        sums = quantize(mine.view(1, length), block, stochastic=True)
        staging = torch.empty((n, sums.shape[1]), dtype=torch.int8, device=t.device)
        work = comm.all_gather(staging.view(-1), sums.view(-1), group, async_op=True, kind=GRADIENTS_KIND,
                               what=what)
        _waited(work, what, timeout_s)
        t.view(-1).copy_(dequantize(staging, length, block).reshape(-1)[:total])
    return _Then(first, then)


def _pair_all_reduce(t: torch.Tensor, group, block: int, gate, what: str):
    """Two replicas (hybrid across two nodes; no_shard at world 2): ONE all-gather of both quantized tensors,
    each rank summing the two dequantized rows in rank order, so both hold the same bits. The same bytes as
    the two-hop form (``payload(L)`` per rank against ``2·payload(L/2)``), but nothing is left to post at
    ``wait``: the whole transfer overlaps backward, and one quantization instead of two. Bound per element:
    ``s_0 + s_1`` (each row's block scale; stochastic rounding, < one step each)."""
    total = t.numel()
    mine = quantize(t.reshape(1, total), block, stochastic=True)
    both = torch.empty((2, mine.shape[1]), dtype=torch.int8, device=t.device)
    work = comm.all_gather(both.view(-1), mine.view(-1), group, async_op=True, kind=GRADIENTS_KIND, gate=gate,
                           what=what)

    def then() -> None:
        flat = t.view(-1)
        if flat.dtype == torch.float32:      # one row dequantized at a time: the peak holds one, not two
            flat.copy_(dequantize(both[0:1], total, block)[0])
            flat.add_(dequantize(both[1:2], total, block)[0])
        else:                                # a lower-precision gradient: sum in float32, round once
            rows = dequantize(both, total, block)
            flat.copy_(rows[0].add_(rows[1]))
    return _Then(work, then)
