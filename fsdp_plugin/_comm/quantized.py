"""Quantized unit collectives (ZeRO++ qwZ / qgZ), opt-in through ``ShardingConfig(quantization=fp.Quantization())``.

Format (one row per destination or source rank): ``[int8 codes, nb·block | float32 scales, nb]`` (``int4``
gradients: two 4-bit codes per byte, ``nb·block/2`` bytes, scale ``absmax / 7``) as one int8
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
GRADIENTS_KIND_4 = "reduce_q4"
BITS = {"int8": 8, "int4": 4}
_QMAX = {8: 127.0, 4: 7.0}       # symmetric: int4 codes -7..7 stored as 1..15 (4 bits), two per byte
_TINY = torch.finfo(torch.float32).tiny     # an all-zero block divides by this (codes 0), its stored scale is 0


def blocks(length: int, block: int) -> int:
    """Blocks (one scale each) of a row of ``length`` values."""
    return -(-length // block)


def payload_elems(length: int, block: int, bits: int = 8) -> int:
    """int8 elements (= bytes) of one quantized row of ``length`` values: codes (``bits`` each), then float32
    scales."""
    nb = blocks(length, block)
    return _code_bytes(nb, block, bits) + 4 * nb


def _code_bytes(nb: int, block: int, bits: int) -> int:
    return nb * block * bits // 8          # block % 8 == 0: whole bytes, scales stay 4-aligned


def bits_of(quant, what: str) -> int:
    """Bits per code of ``quant``'s ``what`` ("weights" / "gradients") format."""
    return BITS[getattr(quant, what)]


def gradients_kind(bits: int) -> str:
    """The ``fp.comm_stats`` kind of a quantized gradient collective with ``bits``-bit codes."""
    return GRADIENTS_KIND if bits == 8 else GRADIENTS_KIND_4


def quantize(rows: torch.Tensor, block: int, stochastic: bool = False, bits: int = 8) -> torch.Tensor:
    """``rows`` (R, L) of any float dtype -> (R, payload_elems(L, block, bits)) int8 rows (module docstring).
    ``stochastic``: round up with probability frac(x / scale) (unbiased: E[code·scale] = x; error < scale),
    from this process's own noise (`_stochastic_biased`); else to nearest. On CPU in tiles of ~256 K values
    spanning all rows (`dequantize_into`'s reason: the temporaries stay in cache)."""
    r, length = rows.shape
    nb = blocks(length, block)
    x = rows.float()
    if nb * block != length:
        x = F.pad(x, (0, nb * block - length))
    x = x.view(r, nb, block)
    out = torch.empty((r, payload_elems(length, block, bits)), dtype=torch.int8, device=rows.device)
    codes, scale = out[:, :_code_bytes(nb, block, bits)], _scales(out, length, block, bits)
    step = min(nb, max(1, _TILE_ELEMS_CPU // (r * block))) if rows.device.type == "cpu" else nb
    for i in range(0, nb, step):
        j = min(i + step, nb)
        _quantize_tile(x[:, i:j], codes[:, i * block * bits // 8:j * block * bits // 8], scale[:, i:j],
                       stochastic, bits)
    return out


def _quantize_tile(x: torch.Tensor, code_bytes: torch.Tensor, scale_out: torch.Tensor, stochastic: bool,
                   bits: int) -> None:
    """Blocks ``x`` (R, b, block) -> their codes (R, b·block·bits/8 bytes) and scales (R, b)."""
    r, b, block = x.shape
    qmax = _QMAX[bits]
    # absmax as max(amax, -amin): two reads, no |x| temporary of the whole tile
    scale = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_()).div_(qmax)   # (R, b); 0: all-zero block
    divisor = scale.clamp_min(_TINY).unsqueeze(-1)
    if not stochastic:      # |x / scale| <= qmax by construction (up to float rounding, far from +0.5)
        codes = torch.div(x, divisor).round_()
        if bits == 8:
            code_bytes.copy_(codes.reshape(r, b * block))
        else:
            _pack4(codes.add_(qmax + 1), code_bytes)
    elif bits == 8:
        code_bytes.view(torch.uint8).copy_(_stochastic_biased(x, divisor, qmax).reshape(r, b * block))
        code_bytes.view(torch.uint8).bitwise_xor_(0x80)      # code + 128 -> the int8 code (two's complement)
    else:
        _pack4(_stochastic_biased(x, divisor, qmax), code_bytes)
    scale_out.copy_(scale)


def _pack4(biased: torch.Tensor, out: torch.Tensor) -> None:
    """Float codes + 8 (1..15) -> ``out`` (R, M) bytes, two codes each: low nibble the first, high the second."""
    u = biased.to(torch.uint8).view(out.shape[0], -1, 2)
    out.view(torch.uint8).copy_(u[..., 0].bitwise_or(u[..., 1].bitwise_left_shift(4)))


def _unpack4(code_bytes: torch.Tensor) -> torch.Tensor:
    """(R, M) bytes of `_pack4` -> (R, 2M) int8 codes in -7..7."""
    u = code_bytes.view(torch.uint8)
    pairs = torch.stack((u.bitwise_and(15), u.bitwise_right_shift(4)), dim=-1).view(torch.int8).sub_(8)
    return pairs.view(u.shape[0], -1)


_SEED_BASE = 0x5EED0000     # + the global rank (benchmarks/quantized_gpt.py --noise-seed shifts it)
_GENERATORS: dict = {}


_DITHER = 2.0 ** -16      # the noise grid: 16 random bits per element


def _stochastic_biased(x: torch.Tensor, divisor: torch.Tensor, qmax: float) -> torch.Tensor:
    """``x / divisor + u + qmax + 1`` as float32, clamped to ``1 .. 2·qmax + 1``: its conversion to uint8, which
    truncates, is the code ``floor(x / divisor + u)`` plus its bias ``qmax + 1``; ``u`` uniform on the grid
    ``k·2⁻¹⁶`` in [0, 1).
    Stochastic rounding from 16 random bits per element: one 64-bit draw of this process's generator
    (`_generator`: the user's RNG streams are untouched) dithers four elements, ~1 ns per element against
    ~4 ns for ``torch.rand`` (and a cheaper table-based noise was tried and widened the held-out spread over
    noise seeds, RESULTS § 35c). Bias: |E[code] − x / divisor| < 2⁻¹⁵ of a step (the grid's ``2⁻¹⁶`` and the
    float32 rounding of the sum, whose ulp is at most 2⁻¹⁶ below 256); error < one step (u ≤ 1 − 2⁻¹⁶).
    ``x.numel() % 4 == 0`` (whole blocks, block % 8 == 0)."""
    off = qmax + 1
    draws = torch.empty(x.numel() // 4, dtype=torch.int64, device=x.device)
    bits16 = draws.random_(-2 ** 63, None, generator=_generator(x.device)).view(torch.int16).view(x.shape)
    # k + 2^15 in 0..65535, exact in float32: (k + (off + 1/2)·2^16)·2^-16 = off + u, u = (k + 2^15)·2^-16
    v = torch.add(bits16, (off + 0.5) / _DITHER).mul_(_DITHER)
    return v.addcdiv_(x, divisor).clamp_(1.0, 2 * qmax + 1)   # x / divisor may pass qmax by a rounding


def _generator(device: torch.device) -> torch.Generator:
    """The stochastic-rounding generator of ``device``: seeded by the global rank (ranks round independently,
    runs repeat), apart from torch's default generators (dropout and the user's sampling do not shift)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    key = (device, rank, os.getpid())         # a forked process starts its own stream
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device).manual_seed(_SEED_BASE + rank)
    return _GENERATORS[key]


def dequantize(payload: torch.Tensor, length: int, block: int, bits: int = 8) -> torch.Tensor:
    """(R, payload) int8 rows -> (R, L) float32 values."""
    r, nb = payload.shape[0], blocks(length, block)
    codes = payload[:, :_code_bytes(nb, block, bits)]
    if bits == 4:
        codes = _unpack4(codes)
    scale = _scales(payload, length, block, bits).unsqueeze(-1)
    return torch.mul(codes.reshape(r, nb, block), scale).view(r, nb * block)[:, :length]   # int8 * f32 -> f32


_TILE_ELEMS_CPU = 1 << 18      # 1 MiB of float32: a tile and its partner stay in a CPU core's cache


def dequantize_into(dst: torch.Tensor, payload: torch.Tensor, length: int, block: int, bits: int = 8,
                    own: Optional[torch.Tensor] = None, me: int = -1) -> None:
    """``dst`` (1-D, contiguous, ``n ≤ length`` values) = the sum in row order of ``payload``'s (R, P) rows of
    ``length`` values dequantized (row ``me``: ``own``, exact, instead), in float32, rounded once to ``dst``'s
    dtype; only the first ``n`` values. On CPU in tiles of ~256 K values, each row's dequantized tile added
    while in cache: a sum of two 25 M-value rows took 0.6 against 7.5 ns per value untiled (RESULTS § 35k);
    elsewhere one tile (a GPU kernel streams)."""
    n, nb = dst.numel(), blocks(min(dst.numel(), length), block)
    codes = payload[:, :_code_bytes(blocks(length, block), block, bits)]
    scale = _scales(payload, length, block, bits).unsqueeze(-1)           # (R, blocks, 1)
    step = min(nb, max(1, _TILE_ELEMS_CPU // block)) if dst.device.type == "cpu" else nb
    tile = part = None
    for i in range(0, nb, step):
        j = min(i + step, nb)
        e0, e1 = i * block, min(j * block, n)
        direct = dst.dtype == torch.float32 and e1 - e0 == (j - i) * block
        if direct:                                       # whole blocks of a float32 destination: sum in place
            acc = dst[e0:e1].view(j - i, block)
        else:
            tile = torch.empty((step, block), dtype=torch.float32, device=dst.device) if tile is None else tile
            acc = tile[:j - i]
        for row in range(payload.shape[0]):
            if row == 0:
                into = acc
            else:
                part = torch.empty((step, block), dtype=torch.float32, device=dst.device) if part is None else part
                into = part[:j - i]
            if row == me:
                into.view(-1)[:e1 - e0].copy_(own[e0:e1])
            else:
                torch.mul(_tile_codes(codes[row:row + 1], e0, j * block, bits).view(j - i, block), scale[row, i:j],
                          out=into)
            if row > 0:
                acc.add_(into)
        if not direct:
            dst[e0:e1].copy_(acc.view(-1)[:e1 - e0])


def dequantize_rows_into(dst: torch.Tensor, payload: torch.Tensor, length: int, block: int, bits: int = 8) -> None:
    """``dst`` (R, n ≤ length; rows may be strided) = each of ``payload``'s R rows of ``length`` values
    dequantized, its first ``n`` values, rounded to ``dst``'s dtype: `dequantize_into`'s tiles spanning all rows
    (one call per ~256 K values whatever R: a gather over many ranks costs no Python loop per rank)."""
    r, n = dst.shape
    nb = blocks(min(n, length), block)
    codes = payload[:, :_code_bytes(blocks(length, block), block, bits)]
    scale = _scales(payload, length, block, bits).unsqueeze(-1)           # (R, blocks, 1)
    step = min(nb, max(1, _TILE_ELEMS_CPU // (r * block))) if dst.device.type == "cpu" else nb
    tile = None
    for i in range(0, nb, step):
        j = min(i + step, nb)
        e0, e1 = i * block, min(j * block, n)
        direct = dst.dtype == torch.float32 and e1 - e0 == (j - i) * block
        if direct:
            into = dst[:, e0:e1].view(r, j - i, block)
        else:
            tile = torch.empty((r, step, block), dtype=torch.float32, device=dst.device) if tile is None else tile
            into = tile[:, :j - i]
        torch.mul(_tile_codes(codes, e0, j * block, bits).reshape(r, j - i, block), scale[:, i:j], out=into)
        if not direct:
            dst[:, e0:e1].copy_(into.reshape(r, -1)[:, :e1 - e0])


def _tile_codes(codes: torch.Tensor, e0: int, e1: int, bits: int) -> torch.Tensor:
    """The int8 codes of values ``e0 .. e1`` (whole blocks) of each row of ``codes`` (the payload's code bytes)."""
    return _unpack4(codes[:, e0 // 2:e1 // 2]) if bits == 4 else codes[:, e0:e1]


def scales(payload: torch.Tensor, length: int, block: int, bits: int = 8) -> torch.Tensor:
    """The (R, nb) float32 block scales of quantized rows (a view)."""
    return _scales(payload, length, block, bits)


def _scales(payload: torch.Tensor, length: int, block: int, bits: int = 8) -> torch.Tensor:
    # block % 8 == 0 keeps every row's scale bytes 4-aligned, so the int8 bytes can be viewed as float32
    return payload[:, _code_bytes(blocks(length, block), block, bits):].view(torch.float32)


class _Then:
    """A work whose ``wait`` waits ``work`` and then runs ``then`` once (dequantize, sum): waited like a torch
    Work by ``collectives.wait`` (its ``fp_op`` is the inner collective's record, for deadline reports; the
    deadline monitor polls the inner ``work``, ``deadlines.Handle``)."""

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
        dequantize_rows_into(out.view(n, length), staging, length, block)
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
    length, block, bits = rows.shape[1], quant.block_size, bits_of(quant, "gradients")
    sent = quantize(rows, block, stochastic=True, bits=bits)
    got = torch.empty_like(sent)
    work = comm.exchange(got, sent, group, kind=gradients_kind(bits), gate=gate, what=what)

    def then() -> None:        # float32 sum in rank order of this rank's exact chunk and the peers' dequantized
        dequantize_into(out.view(-1), got, length, block, bits, own=rows[me], me=me)
    return _Then(work, then)


def all_reduce(quant, t: torch.Tensor, group, gate=None, what: str = "all-reduce",
               timeout_s: Optional[float] = None):
    """Unit all-reduce of ``t`` in place: exact unless ``quant.gradients``; then a quantized reduce-scatter of
    ``t`` padded to the group (``reduce_scatter``, float32 sums) and, when waited, an all-gather of the
    re-quantized sums dequantized into ``t`` on every rank (the same values on every replica). Async."""
    if not applies(quant, "gradients", group):
        # asynchronous on every transport, waited by the caller (``flat_param.wait_reduce``): a blocking wait
        # here was a host poll per unit inside backward on NCCL (no_shard, hybrid's replica hop)
        return comm.all_reduce(t, group, async_op=True, gate=gate, what=what)
    n, total, block, bits = comm.group_size(group), t.numel(), quant.block_size, bits_of(quant, "gradients")
    if n == 2:
        return _pair_all_reduce(t, group, block, bits, gate, what)
    length = -(-total // n)
    padded = t.reshape(-1) if length * n == total else F.pad(t.reshape(-1), (0, length * n - total))
    mine = torch.empty(length, dtype=torch.float32, device=t.device)
    first = reduce_scatter(quant, mine, padded, group, gate=gate, what=what)

    def then() -> None:
        sums = quantize(mine.view(1, length), block, stochastic=True, bits=bits)
        staging = torch.empty((n, sums.shape[1]), dtype=torch.int8, device=t.device)
        work = comm.all_gather(staging.view(-1), sums.view(-1), group, async_op=True, kind=gradients_kind(bits),
                               what=what)
        _waited(work, what, timeout_s)
        flat, whole = t.view(-1), total // length        # whole rows, then the last one's first values
        dequantize_rows_into(flat[:whole * length].view(whole, length), staging[:whole], length, block, bits)
        if whole < n:
            dequantize_into(flat[whole * length:], staging[whole:whole + 1], length, block, bits)
    return _Then(first, then)


def _pair_all_reduce(t: torch.Tensor, group, block: int, bits: int, gate, what: str):
    """Two replicas (hybrid across two nodes; no_shard at world 2): ONE all-gather of both quantized tensors,
    each rank summing the two dequantized rows in rank order, so both hold the same bits. The same bytes as
    the two-hop form (``payload(L)`` per rank against ``2·payload(L/2)``), but nothing is left to post at
    ``wait``: the whole transfer overlaps backward, and one quantization instead of two. Bound per element:
    ``s_0 + s_1`` (each row's block scale; stochastic rounding, < one step each)."""
    total = t.numel()
    mine = quantize(t.reshape(1, total), block, stochastic=True, bits=bits)
    both = torch.empty((2, mine.shape[1]), dtype=torch.int8, device=t.device)
    work = comm.all_gather(both.view(-1), mine.view(-1), group, async_op=True, kind=gradients_kind(bits), gate=gate,
                           what=what)

    def then() -> None:      # both rows in rank order, summed in float32, rounded once to the gradient's dtype
        dequantize_into(t.view(-1), both, total, block, bits)
    return _Then(work, then)
