"""Ring attention (``context_parallel_attention="ring"``): K/V blocks rotate around the CP group.

The same tiles and online softmax as the all-gather attention (``blockwise.py``: ``_Rows`` / ``Grads``, one call
per source block), but a rank never holds the group's K/V: at step s of C it computes its query tiles against
CP rank (r − s) mod C's block while that block goes on to rank r + 1 and the next one arrives from r − 1
(``comm.rotate``, counted as ``cp_kv_ring``). Two block buffers at any time (the one computed on, the one in
flight) instead of C; the same (C−1)/C·S·2·Hkv·d elements on the wire, in C−1 messages per layer.
The price: every query tile's online-softmax state (an output-sized buffer in the compute dtype) lives across
the C steps, where the all-gather attention keeps one tile's.

Backward rotates K/V again (``cp_kv_ring_bwd``). dK/dV travel with the block: rank r adds its queries'
contribution to the block it holds and passes the partial sum on (``cp_dkv_ring``); after the last step each
sum arrives at its owner, which adds its own queries' part (kept from step 0): C−1 messages, the
reduce-scatter's (C−1)/C bytes, in K/V's dtype.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._comm import collectives as comm
from .blockwise import Grads, _Rows, _shapes, block_keys, outputs
from .split import Layout
from .tiles import plan


def _block(k, v) -> torch.Tensor:
    """(2, B, Hkv, T, D): one rank's K/V as one buffer (what travels). The ring's only K/V allocations."""
    return torch.stack([k, v]).contiguous()


def blocks(k, v, layout: Layout, kind: str):
    """Yield (source CP rank, its (2, B, Hkv, T, D) K/V) for the C steps, this rank's own first; each block's
    successor is in flight while the caller computes on it. Must be iterated to the end (rotations pending)."""
    cp, me = layout.cp, layout.cp_rank
    cur = _block(k, v)
    nxt = torch.empty_like(cur) if cp > 1 else None
    for s in range(cp):
        work = comm.rotate(nxt, cur, layout.group, kind=kind, what="context-parallel K/V ring") if s < cp - 1 \
            else None
        yield (me - s) % cp, cur
        comm.wait(work, "context-parallel K/V ring")
        cur, nxt = nxt, cur


class RingAttention(torch.autograd.Function):
    """``BlockAttention``'s interface and results, K/V rotated instead of gathered."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, scale, softcap, causal, window):
        p = plan(layout, causal, window, uniform=softcap is not None and sinks is None)
        b, h, hkv, rep, t, d, cdt = _shapes(q, k)
        q5 = q.reshape(b, hkv, rep, t, d)
        rows = [_Rows(q5, i, p, cdt) for i in range(len(p.rows))]
        for src, kv in blocks(k, v, layout, "cp_kv_ring"):
            js, base = block_keys(p, layout, src)
            for st in rows:
                st.add(q5, kv[0], kv[1], js, base, layout, p, scale, softcap, causal, window)
        out, lse = outputs(q, cdt)
        for st in rows:
            st.finish(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (layout, p, scale, softcap, causal, window)
        return out

    @staticmethod
    @once_differentiable       # the backward is hand-written: no double backward
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, p, scale, softcap, causal, window = ctx.args
        g = Grads(dout, q, k.shape[1], out, lse)
        shape = (2,) + tuple(k.shape)
        own = inbox = work = None
        send = torch.empty(shape, dtype=k.dtype, device=k.device) if layout.cp > 1 else None
        for step, (src, kv) in enumerate(blocks(k, v, layout, "cp_kv_ring_bwd")):
            js, base = block_keys(p, layout, src)
            dkv = torch.zeros(shape, dtype=g.cdt, device=q.device)
            for i in range(len(p.rows)):
                g.add(i, kv[0], kv[1], dkv, js, base, layout, p, scale, softcap, causal, window)
            if step == 0:
                own = dkv                 # this rank's queries' part of its own dK/dV: added last
                continue
            if work is not None:          # the partial sum of block ``src`` from rank r − 1
                comm.wait(work, "context-parallel dK/dV ring")
                dkv += inbox
            inbox = inbox if inbox is not None else torch.empty_like(send)
            send.copy_(dkv)
            work = comm.rotate(inbox, send, layout.group, kind="cp_dkv_ring", what="context-parallel dK/dV ring")
        if work is not None:              # every other rank's part of this rank's dK/dV
            comm.wait(work, "context-parallel dK/dV ring")
            own += inbox
        dkv = own.to(k.dtype)
        return g.dq.to(q.dtype), dkv[0], dkv[1], g.dsinks(sinks, lse), None, None, None, None, None
