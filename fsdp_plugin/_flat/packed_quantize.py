"""4-bit bases built under ``fp.deferred_init()``: quantized by the engine, whole at ``fp.shard``, per shard at load.

The 70B QLoRA path (two 24 GB cards): build the model's skeleton with bitsandbytes ``Linear4bit`` layers under
``fp.deferred_init()`` (transformers' ``replace_with_bnb_linear``), ``fp.shard`` it, then ``fp.load_pretrained``
the full-precision checkpoint: each rank reads only the values its packed bytes hold and quantizes only them.

Exact because bitsandbytes' 4-bit quantization is blockwise over the flattened weight: a block-aligned slice
quantizes to the same bytes and block absmax as the whole weight (each byte holds two consecutive values, each
block of ``blocksize`` values has one absmax; ``bnb.functional.quantize_4bit``'s kernels never look across
blocks). So a rank quantizes the aligned superset of its piece and keeps its own bytes (the engine's shard
boundaries are not block-aligned; boundary blocks are read by both neighbours). ``quant_state`` stays whole on
every rank (``packed.py``): the absmax pieces are all-reduced (max over zero-filled pieces: every block is
covered by at least one rank, overlapping blocks hold equal values), then double quantization
(``compress_statistics``: absmax minus its mean, quantized in blocks of 256) runs on the whole absmax exactly as
``quantize_4bit`` runs it. 8-bit skeletons (``Linear8bitLt``) are not quantized here (refused by ``packed.prepare``).

Before the load, ``fp.shard`` replays each deferred 4-bit weight (one unit at a time, as for any deferred
parameter) and quantizes it whole, as eager construction and ``model.to(device)`` would: the sharded model is
the eager one, and ``fp.load_pretrained`` then overwrites bytes and ``quant_state``.
"""
from __future__ import annotations

import math

import torch


def pending(p) -> bool:
    """A 4-bit weight recorded under ``fp.deferred_init()`` and not quantized yet (full-precision shape)."""
    from .._deferred import is_deferred

    return getattr(p, "bnb_quantized", True) is False and p.is_meta and is_deferred(p)


def packed_shape(numel: int, storage: torch.dtype) -> tuple[int, int]:
    """The shape ``quantize_4bit`` gives a weight of ``numel`` values: two values a byte, viewed as ``storage``."""
    nbytes = (numel + 1) // 2
    size = torch.empty((), dtype=storage).element_size()
    return (nbytes // size, 1)


def defer(p) -> None:
    """Turn a pending weight into a packed one of the quantized shape (on the meta device), keeping the recorded
    full-precision tensor beside it (``_fp_float``), which ``quantize_whole`` replays and quantizes at build time."""
    src = p.data
    p.data = torch.empty(packed_shape(src.numel(), p.quant_storage), dtype=p.quant_storage, device="meta")
    p._fp_float = src
    p.bnb_quantized = True


def quantize_whole(p, values: torch.Tensor) -> torch.Tensor:
    """``values`` (the full-precision weight) quantized as ``Params4bit._quantize`` does; sets ``quant_state``
    on ``p`` (and its module, as bitsandbytes does) and returns the packed bytes."""
    import bitsandbytes as bnb

    packed, state = bnb.functional.quantize_4bit(values.contiguous(), blocksize=p.blocksize,
                                                 compress_statistics=p.compress_statistics,
                                                 quant_type=p.quant_type, quant_storage=p.quant_storage)
    p.quant_state = state
    if getattr(p, "module", None) is not None:
        p.module.quant_state = state
    del p._fp_float
    return packed


def piece_values(start: int, end: int, itemsize: int, numel: int, blocksize: int) -> tuple[int, int]:
    """The block-aligned range of flattened values ``[lo, hi)`` whose quantization holds packed elements
    ``[start, end)`` (of ``itemsize`` bytes; two values a byte). Empty piece: ``(0, 0)``."""
    if end <= start:
        return 0, 0
    v0, v1 = 2 * start * itemsize, min(numel, 2 * end * itemsize)
    return v0 // blocksize * blocksize, min(numel, math.ceil(v1 / blocksize) * blocksize)


def quantize_piece(p, values: torch.Tensor, lo: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``values`` (flattened values ``[lo, ...)``, block-aligned): this rank's packed bytes (elements
    ``[start, end)`` of ``p``, as uint8) and the absmax of blocks ``lo // blocksize`` onward."""
    import bitsandbytes as bnb

    size = p.element_size()
    packed, state = bnb.functional.quantize_4bit(values, blocksize=p.quant_state.blocksize, compress_statistics=False,
                                                 quant_type=p.quant_state.quant_type, quant_storage=torch.uint8)
    first = start * size - lo // 2
    return packed.view(-1)[first:first + (end - start) * size], state.absmax


def whole_state(p, absmax: torch.Tensor):
    """The ``QuantState`` ``quantize_4bit`` builds for the whole weight from its block ``absmax`` (double
    quantization, when ``p`` asks for it, on the whole absmax as bitsandbytes does)."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState, get_4bit_type

    old = p.quant_state
    common = dict(shape=old.shape, dtype=old.dtype, blocksize=old.blocksize,
                  code=get_4bit_type(old.quant_type, device=absmax.device), quant_type=old.quant_type)
    if not p.compress_statistics:
        return QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    qabsmax, state2 = bnb.functional.quantize_blockwise(absmax - offset, blocksize=256)
    return QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)


def set_state(p, state) -> None:
    """Replace ``p``'s quant_state contents in place: every view ``rewrap`` made shares the object."""
    p.quant_state.__dict__.clear()
    p.quant_state.__dict__.update(state.__dict__)


def planned(p) -> tuple[tuple, torch.dtype] | None:
    """``(packed shape, storage dtype)`` that ``defer`` will give a pending 4-bit weight (what ``fp.plan`` counts
    before ``fp.shard`` has run), else None."""
    if not pending(p):
        return None
    return packed_shape(p.numel(), p.quant_storage), p.quant_storage


def float_shape(p) -> tuple:
    """The full-precision ``(out, in)`` shape a 4-bit weight stands for: its ``quant_state``'s, or (pending or
    deferred, not quantized yet) the recorded weight's."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        return tuple(state.shape)
    return tuple(getattr(p, "_fp_float", p).shape)


def state_bytes(p) -> int:
    """Bytes of the ``quant_state`` tensors a 4-bit weight holds whole on every rank: block absmax (fp32, or
    uint8 under double quantization with its fp32 absmax per 256 blocks, 256-entry code and offset) and the
    16-entry code book. From the state when there is one, else from the layer's settings (pending weights)."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        tensors = [state.absmax, state.code]
        if state.nested:
            tensors += [state.offset, state.state2.absmax, state.state2.code]
        return sum(t.numel() * t.element_size() for t in tensors)
    numel = 1
    for d in float_shape(p):
        numel *= d
    blocks = -(-numel // p.blocksize)
    if not p.compress_statistics:
        return blocks * 4 + 16 * 4
    return blocks + 16 * 4 + 4 + -(-blocks // 256) * 4 + 256 * 4
