"""``fp.load_pretrained`` of a full-precision checkpoint into 4-bit weights, quantized shard by shard.

Each rank reads the block-aligned values its packed bytes hold (one ranged read per weight, cast to the dtype
bitsandbytes quantizes in, ``quant_state.dtype``), quantizes them and keeps its own bytes; the block absmax
pieces are all-reduced so that every rank builds the whole ``quant_state`` (``_flat/packed_quantize.py`` says
why this is bit-identical to ``quantize_4bit`` of the whole weight). Weights are read one at a time: a rank
holds at most one piece of full-precision values (plus its absmax pieces, 1/world of the fp32 absmax, on the
host until the all-reduces), and reads about 1/world of the base in all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..._comm import collectives as comm
from ..._flat import packed_quantize
from ..._flat.packed import _bnb_class, is_packed
from ..format import _format
from .. import _comm, _model
from ..errors import CheckpointError


def float_shape(p) -> tuple | None:
    """The full-precision shape a checkpoint holds for a packed 4-bit weight (None: not one)."""
    if _bnb_class(p) != "Params4bit" or not is_packed(p) or getattr(p, "quant_state", None) is None:
        return None
    return tuple(p.quant_state.shape)


def load(plan, items: list) -> None:
    """``items``: ``(param, start, end, (file, entry))`` for every packed 4-bit weight, in the same order on
    every rank. Collective: every rank reads and quantizes its pieces, the ranks agree that all did (so that a
    rank's read error is every rank's error, not a hang in the next collective), then one absmax all-reduce per
    weight builds each whole ``quant_state``."""
    pieces, err = [], None
    try:
        pieces = [_quantize_own(plan, p, start, end, f, e) for p, start, end, (f, e) in items]
    except Exception as e:  # noqa: BLE001 - agreed on below, re-raised
        err = e
    if _comm.active() and not _comm.all_true(err is None, "quantizing 4-bit weights"):
        raise err or CheckpointError("fp.load_pretrained: another rank failed reading or quantizing its pieces of "
                                     "the 4-bit weights (its error is raised there)")
    if err is not None:
        raise err
    for (p, *_), (block0, absmax_piece) in zip(items, pieces):
        _finish(p, block0, absmax_piece)


def _quantize_own(plan, p, start: int, end: int, f, e) -> tuple[int, torch.Tensor | None]:
    """Read the block-aligned values holding this rank's piece, quantize them, write its own packed bytes;
    returns ``(first block, its absmax pieces on CPU)`` (None: no piece here)."""
    state = p.quant_state
    numel, bs = int(torch.Size(state.shape).numel()), state.blocksize
    lo, hi = packed_quantize.piece_values(start, end, p.element_size(), numel, bs)
    if hi <= lo:
        return 0, None
    values = torch.empty(hi - lo, dtype=state.dtype)
    src = _format.to_dtype(e.dtype)
    plan.add(f, e.begin + lo * src.itemsize, src, values, e.name)
    plan.execute()
    own, absmax = packed_quantize.quantize_piece(p, values.to(p.device), lo, start, end)
    del values
    dest, tmp = _model.flat_dest(p.data)
    dest.view(torch.uint8).copy_(own)
    if tmp is not None:
        p.data.copy_(tmp)
    return lo // bs, absmax.cpu()


def _finish(p, block0: int, piece) -> None:
    """The whole absmax from every rank's pieces (zero-filled elsewhere, absmax >= 0: the max is each block's
    absmax; a boundary block comes from both neighbours, equal), then the whole ``quant_state``."""
    state = p.quant_state
    numel, bs = int(torch.Size(state.shape).numel()), state.blocksize
    device = comm.device() if _comm.active() else p.device
    absmax = torch.zeros((numel + bs - 1) // bs, dtype=torch.float32, device=device)
    if piece is not None:
        absmax[block0:block0 + piece.numel()] = piece.to(device)
    if _comm.active():
        comm.all_reduce(absmax, None, op=dist.ReduceOp.MAX, kind="control",
                        what=_comm._what("4-bit absmax"), timeout_s=_comm._timeout())
    packed_quantize.set_state(p, packed_quantize.whole_state(p, absmax.to(p.device)))
