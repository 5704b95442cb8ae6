"""Attention over a split sequence, registered in transformers' attention registry.

All-gather K/V (the default): every rank gathers the un-repeated (GQA) keys and values of its context-parallel
group in one collective per layer and computes its own queries against the whole sequence tile by tile with an
online softmax (``blockwise.py``; masks per tile from ``Layout.block_mask``: causal, sliding window, padding,
packed documents; attention sinks and soft-capping as transformers' eager attention computes them), never
holding a (local x sequence) tensor nor keeping the gathered K/V for backward (it gathers them again there and
reduce-scatters dK/dV to their owners).
Ring (``context_parallel_attention="ring"``, ``ring.py``): the same tiles, K/V blocks rotated around the group
instead of gathered (two blocks held instead of C; same bytes, C−1 messages per layer).
Ulysses (``context_parallel_attention="ulysses"``): an all-to-all turns (this rank's positions, all heads)
into (every position, this rank's H/C heads) for q, k and v; attention runs over the whole sequence for those
heads with the same global mask; a fourth all-to-all brings the output back to this rank's positions.
Collectives go through ``_comm.collectives`` (all_gather / reduce_scatter / exchange: deadlines, byte counters).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._comm import collectives as comm
from ..errors import UnsupportedError
from .blockwise import BlockAttention
from .ring import RingAttention
from .split import Layout

KEY = "fsdp_plugin_cp"      # config._attn_implementation while context parallel is on
STATE = "fsdp_plugin_cp_layout"   # the keyword argument that carries the forward's Layout down to attention


class _AllToAll(torch.autograd.Function):
    """Row j of ``x`` (C, ...) goes to CP rank j; row r of the result came from CP rank r. Its own inverse, so
    backward sends each gradient row back where it came from."""

    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return _exchange(x, group, kind)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.kind), None, None


def _exchange(x, group, kind):
    x = x.contiguous()
    out = torch.empty_like(x)
    work = comm.exchange(out.view(x.shape[0], -1), x.view(x.shape[0], -1), group, kind=kind,
                         what="context-parallel Ulysses all-to-all")
    comm.wait(work, "context-parallel Ulysses all-to-all")
    return out


def _to_heads(x, layout):
    """(B, heads, T, D) at this rank's positions -> (B, heads/C, C*T, D): every position (kv_index order), this
    rank's head group."""
    b, h, t, d = x.shape
    c = layout.cp
    rows = x.reshape(b, c, h // c, t, d).transpose(0, 1)                      # (C: head group, B, h/C, T, D)
    got = _AllToAll.apply(rows, layout.group, "cp_ulysses")                   # (C: source rank, B, h/C, T, D)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)


def _to_positions(x, layout, heads):
    """The inverse of ``_to_heads`` for the output: (B, H/C, C*T, D) -> (B, H, T, D) at this rank's positions."""
    b, hc, ct, d = x.shape
    c = layout.cp
    t = ct // c
    rows = x.reshape(b, hc, c, t, d).permute(2, 0, 1, 3, 4)                   # (C: position owner, B, H/C, T, D)
    got = _AllToAll.apply(rows, layout.group, "cp_ulysses")                   # (C: head group, B, H/C, T, D)
    return got.transpose(0, 1).reshape(b, heads, t, d)


def _attend(q, k, v, mask, scale, sinks=None, softcap=None, padding=None):
    """Attention of q (B, H, Tq, D) over k/v (B, Hkv, Tk, D) under the bool ``mask``: torch's SDPA, or, with
    attention sinks (gpt-oss's ``s_aux``: one extra logit per head in the softmax, no value) or logit
    soft-capping (Gemma 2), transformers' eager formulas with their additive dtype-minimum mask (so that a
    query that sees no key behaves as in one process there too: uniform over the real keys, which is why the
    keys the split padded on (``padding``, bool over keys) get -inf instead)."""
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    bias = torch.zeros(mask.shape, dtype=logits.dtype, device=logits.device)
    bias.masked_fill_(~mask, torch.finfo(logits.dtype).min)
    if padding is not None:
        bias.masked_fill_(padding.to(bias.device), float("-inf"))
    logits = logits + bias
    if sinks is None:
        probs = F.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        both = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)], -1)
        both = both - both.max(-1, keepdim=True).values
        probs = F.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _ulysses(module, query, key, value, layout, scaling, causal, window, sinks, softcap):
    h, hkv, c = query.shape[1], key.shape[1], layout.cp
    if h % c or hkv % c:
        raise UnsupportedError(f"{type(module).__name__}: context_parallel_attention='ulysses' splits heads over the "
                               f"{c} CP ranks, but this layer has {h} query and {hkv} key/value heads; use "
                               "context_parallel_attention='allgather' (any head count) or a CP size dividing both")
    q, k, v = (_to_heads(x, layout) for x in (query, key, value))
    mask = layout.mask(causal, window, query.device, all_queries=True)
    if sinks is not None:       # this rank's head group's sinks
        sinks = sinks.reshape(c, h // c)[layout.cp_rank]
    out = _attend(q, k, v, mask, scaling, sinks, softcap, layout.kv_index >= layout.seq_len)
    return _to_positions(out, layout, h).transpose(1, 2).contiguous(), None


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                 **kwargs):
    """transformers' attention interface: q (B, H, T, D) at this rank's positions, k/v (B, Hkv, T, D) un-repeated;
    returns ((B, T, H, D), None) as ``sdpa_attention_forward`` does."""
    layout = kwargs.get(STATE)
    if not isinstance(layout, Layout):
        raise UnsupportedError(f"{type(module).__name__}: the attention ran without the context-parallel layout; "
                               "the model does not pass its keyword arguments down to attention (transformers' "
                               "TransformersKwargs), so it cannot be split: shard it without context_parallel")
    _refuse(module, dropout, kwargs)
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    if layout.method == "ulysses":
        return _ulysses(module, query, key, value, layout, scaling, causal, sliding_window, sinks, softcap)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    fn = RingAttention if layout.method == "ring" else BlockAttention
    out = fn.apply(query, key, value, sinks, layout, scale, softcap, causal, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _refuse(module, dropout, kwargs) -> None:
    name = type(module).__name__
    if dropout:
        raise UnsupportedError(f"{name}: attention dropout ({dropout}) under context_parallel is not supported "
                               "(each rank would drop different keys than one process); set the config's "
                               "attention_dropout=0.0")
    if kwargs.get("output_attentions"):
        raise UnsupportedError(f"{name}: output_attentions under context_parallel: attention weights are never "
                               "materialized; drop output_attentions")


def register() -> None:
    """Add ``KEY`` to transformers' registry (idempotent). No mask function is registered for it, so
    transformers builds no local mask (``masking_utils._preprocess_mask_arguments`` exits early)."""
    from transformers import AttentionInterface
    AttentionInterface.register(KEY, cp_attention)
