"""``fp.load_pretrained`` of a full-precision checkpoint into 4-bit weights, quantized shard by shard.

Each rank reads the block-aligned values its packed bytes hold (one ranged read per weight, cast to the dtype
bitsandbytes quantizes in, ``quant_state.dtype``), quantizes them and keeps its own bytes; the block absmax
pieces are all-reduced so that every rank builds the whole ``quant_state`` (``_flat/packed_quantize.py`` says
why this is bit-identical to ``quantize_4bit`` of the whole weight). Weights are done one at a time: a rank
holds at most one piece of full-precision values, and reads about 1/world of the base in all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..._comm import collectives as comm
from ..._flat import packed_quantize
from ..._flat.packed import _bnb_class, is_packed
from ..format import _format
from .. import _comm, _model


def float_shape(p) -> tuple | None:
    """The full-precision shape a checkpoint holds for a packed 4-bit weight (None: not one)."""
    if _bnb_class(p) != "Params4bit" or not is_packed(p) or getattr(p, "quant_state", None) is None:
        return None
    return tuple(p.quant_state.shape)


def load(plan, items: list) -> None:
    """``items``: ``(param, start, end, (file, entry))`` for every packed 4-bit weight, in the same order on
    every rank (collective: one absmax all-reduce per weight)."""
    for p, start, end, (f, e) in items:
        _load_one(plan, p, start, end, f, e)


def _load_one(plan, p, start: int, end: int, f, e) -> None:
    state = p.quant_state
    numel, bs = int(torch.Size(state.shape).numel()), state.blocksize
    device = comm.device() if _comm.active() else p.device
    absmax = torch.zeros((numel + bs - 1) // bs, dtype=torch.float32, device=device)
    lo, hi = packed_quantize.piece_values(start, end, p.element_size(), numel, bs)
    if hi > lo:
        values = torch.empty(hi - lo, dtype=state.dtype)
        src = _format.to_dtype(e.dtype)
        plan.add(f, e.begin + lo * src.itemsize, src, values, e.name)
        plan.execute()
        own = packed_quantize.quantize_piece(p, values.to(p.device), lo, start, end, absmax)
        del values
        dest, tmp = _model.flat_dest(p.data)
        dest.view(torch.uint8).copy_(own)
        if tmp is not None:
            p.data.copy_(tmp)
    if _comm.active():
        # zero-filled elsewhere, absmax >= 0: the max is every block's absmax (boundary blocks: equal values)
        comm.all_reduce(absmax, None, op=dist.ReduceOp.MAX, kind="control",
                        what=_comm._what(f"4-bit absmax of {e.name}"), timeout_s=_comm._timeout())
    packed_quantize.set_state(p, packed_quantize.whole_state(p, absmax.to(p.device)))
