"""All-gather attention that never holds a (local x sequence) tensor: the flash-attention recurrence in plain torch.

Forward: one all-gather of the CP group's un-repeated (GQA) K/V, then, per tile of local query rows, a loop over
key tiles (``tiles.py``: SKIP tiles are not computed, FULL ones take no mask, PART ones a mask of that tile only)
with fp32 scores (``q·kᵀ·scale``, soft-capping), merged by the online softmax (running max, sum, output).
Attention sinks (gpt-oss's ``s_aux``) are one more logit per head in the denominator: added to the final
logsumexp. Saved for backward: q, the LOCAL k/v, the output and the logsumexp; no gathered K/V, no scores.

Backward: gathers K/V again (one more all-gather per layer: (C−1)/C · S · 2·Hkv·d elements), recomputes each
tile's probabilities ``P = exp(S − lse)`` and accumulates ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``,
``dQ = dS K``, ``dK = dSᵀ Q`` (GQA groups summed by the matmuls), then reduce-scatters dK/dV to their owners.

The loops over key tiles (``_Rows.add``, ``Grads.add``) take one source of keys at a time: here the whole
gathered K/V, in ``ring.py`` one rotating rank's block.

A query that sees no key behaves as the whole-mask reference did (tested against one process): output 0 and no
gradient (SDPA; with sinks everything goes to the sink), or, with soft-capping and no sinks (eager's additive
mask), a uniform average over the real keys with eager's gradient (``tiles.py``, "dead" rows).
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._comm import collectives as comm
from .split import Layout
from .tiles import FULL, SKIP, plan, tile_mask


def _gather(k, v, layout: Layout, kind: str):
    """(2, B, Hkv, C·T, D): every CP rank's k and v, keys in ``Layout.kv_index`` order."""
    both = torch.stack([k, v]).contiguous()
    cp = layout.cp
    if cp == 1:
        return both
    out = torch.empty((cp,) + tuple(both.shape), dtype=both.dtype, device=both.device)
    comm.all_gather(out.view(-1), both.view(-1), layout.group, kind=kind, what="context-parallel K/V all-gather")
    two, b, hkv, t, d = both.shape
    return out.permute(1, 2, 3, 0, 4, 5).reshape(two, b, hkv, cp * t, d)


def _scatter(dkv, layout: Layout, dtype):
    """The inverse of ``_gather`` for gradients: sum every rank's dK/dV for this rank's keys (reduce-scatter)."""
    two, b, hkv, s, d = dkv.shape
    cp = layout.cp
    rows = dkv.reshape(two, b, hkv, cp, s // cp, d).permute(3, 0, 1, 2, 4, 5).to(dtype).contiguous()
    if cp == 1:
        return rows[0]
    mine = torch.empty(rows.shape[1:], dtype=dtype, device=rows.device)
    # flat views: the gloo point-to-point path sums (n, -1) chunks into ``out``
    comm.reduce_scatter(mine.view(-1), rows.view(-1), layout.group, what="context-parallel dK/dV reduce-scatter")
    return mine


class _Tile:
    """One tile's scores, masked as the plan says: (B, Hkv, rep·rows, keys) in the compute dtype."""

    def __init__(self, qt, kt, shape, scale, softcap, mask, dead):
        b, hkv, rep, tq = shape
        raw = torch.matmul(qt, kt.transpose(-1, -2)) * scale
        self.tanh = None
        if softcap is not None:
            self.tanh = torch.tanh(raw / softcap)
            raw = self.tanh * softcap
        if mask is not None:
            s5 = raw.view(b, hkv, rep, tq, -1)
            if dead is not None:        # uniform rows: score 0 on every real key (eager's dtype-minimum mask)
                s5 = s5.masked_fill(dead.view(b, 1, 1, tq, 1), 0.0)
            raw = s5.masked_fill(~mask.view(b, 1, 1, tq, -1), float("-inf")).view(raw.shape)
        self.scores = raw


class BlockAttention(torch.autograd.Function):
    """out (B, H, T, D) of local q (B, H, T, D) over the CP group's keys/values, from local k/v (B, Hkv, T, D)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout, scale, softcap, causal, window):
        p = plan(layout, causal, window, uniform=softcap is not None and sinks is None)
        kv = _gather(k, v, layout, "cp_kv")
        out, lse = _forward(q, kv[0], kv[1], sinks, layout, p, scale, softcap, causal, window)
        del kv
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (layout, p, scale, softcap, causal, window)
        return out

    @staticmethod
    @once_differentiable       # the backward is hand-written: no double backward
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        layout, p, scale, softcap, causal, window = ctx.args
        kv = _gather(k, v, layout, "cp_kv_bwd")          # recompute costs one more K/V all-gather per layer
        dq, dkv, dsinks = _backward(dout, q, kv[0], kv[1], out, lse, sinks, layout, p, scale, softcap, causal,
                                    window)
        del kv
        dkv = _scatter(dkv, layout, k.dtype)
        return dq, dkv[0], dkv[1], dsinks, None, None, None, None, None


def _shapes(q, k):
    b, h, t, d = q.shape
    hkv = k.shape[1]
    return b, h, hkv, h // hkv, t, d, torch.promote_types(q.dtype, torch.float32)


def _rows(x5, r, cdt):
    """Rows ``r`` of (B, Hkv, rep, T, d) as (B, Hkv, rep·rows, d): the query heads of one K/V head side by side."""
    b, hkv, _, _, d = x5.shape
    return x5[:, :, :, r].to(cdt).reshape(b, hkv, -1, d)


def _tile(layout, p, i, j, qt, kt, shape, scale, softcap, causal, window):
    mask = dead = None
    if p.state[i][j] != FULL:
        mask = tile_mask(layout, p, causal, window, p.rows[i], p.keys[j], qt.device)
        if p.dead is not None:
            dead = p.dead[:, p.rows[i]].to(qt.device)
    return _Tile(qt, kt, shape, scale, softcap, mask, dead)


def block_keys(p, layout: Layout, src: int) -> tuple:
    """(indices into ``p.keys`` of CP rank ``src``'s key tiles, their offset): a rank's T keys are positions
    ``src·T .. (src+1)·T`` of the gathered order, cut into tiles that never straddle two ranks (``tiles._cuts``)."""
    t = layout.q_index.numel()
    return [j for j, kr in enumerate(p.keys) if kr.start // t == src], src * t


class _Rows:
    """The online-softmax state of one tile of query rows (running max ``m``, sum ``l``, output ``acc``),
    merged over key tiles in any order: one call of ``add`` per source of keys (the whole gathered K/V, or one
    rank's block of the ring)."""

    def __init__(self, q5, i, p, cdt):
        self.i, self.r = i, p.rows[i]
        qt = _rows(q5, self.r, cdt)
        self.m = torch.full(qt.shape[:3], float("-inf"), dtype=cdt, device=q5.device)
        self.l = torch.zeros_like(self.m)
        self.acc = torch.zeros(qt.shape, dtype=cdt, device=q5.device)

    def add(self, q5, kk, vv, js, base, layout, p, scale, softcap, causal, window):
        """Merge key tiles ``js`` (indices into ``p.keys``) of ``kk``/``vv``, which hold keys from ``base`` on."""
        b, hkv, rep, _, d = q5.shape
        cdt = self.acc.dtype
        qt = _rows(q5, self.r, cdt)
        tq = qt.shape[2] // rep
        m, l, acc = self.m, self.l, self.acc
        for j in js:
            if p.state[self.i][j] == SKIP:
                continue
            kr = p.keys[j]
            loc = slice(kr.start - base, kr.stop - base)
            s = _tile(layout, p, self.i, j, qt, kk[:, :, loc].to(cdt), (b, hkv, rep, tq), scale, softcap, causal,
                      window).scores
            new = torch.maximum(m, s.amax(-1))
            safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)   # a row that saw no key yet
            alpha = torch.exp(m - safe)
            e = torch.exp(s - safe[..., None])
            l = l * alpha + e.sum(-1)
            acc = acc * alpha[..., None] + torch.matmul(e, vv[:, :, loc].to(cdt))
            m = new
        self.m, self.l, self.acc = m, l, acc

    def finish(self, out, lse, sinks):
        """Write this tile's rows of ``out`` (B, H, T, D) and ``lse`` (B, H, T); frees the state."""
        b, h, _, d = out.shape
        hkv = self.acc.shape[1]
        rep, cdt = h // hkv, self.acc.dtype
        tq = self.acc.shape[2] // rep
        m, l = self.m, self.l
        total = m + torch.log(l)                      # -inf where no key was seen
        if sinks is not None:
            sink = sinks.to(cdt).view(1, hkv, rep, 1).expand(b, hkv, rep, tq).reshape(b, hkv, rep * tq)
            total = torch.logaddexp(total, sink)
        factor = torch.where(l > 0, torch.exp(m - total), torch.zeros_like(l))
        out[:, :, self.r] = (self.acc * factor[..., None]).view(b, hkv, rep, tq, d).reshape(b, h, tq, d).to(out.dtype)
        lse[:, :, self.r] = total.view(b, h, tq)
        self.m = self.l = self.acc = None


def outputs(q, cdt):
    """Empty (out, lse) for ``q`` (B, H, T, D)."""
    b, h, t, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty((b, h, t), dtype=cdt,
                                                                                    device=q.device)


def _forward(q, kk, vv, sinks, layout, p, scale, softcap, causal, window):
    b, h, hkv, rep, t, d, cdt = _shapes(q, kk)
    out, lse = outputs(q, cdt)
    q5 = q.reshape(b, hkv, rep, t, d)
    every = range(len(p.keys))
    for i in range(len(p.rows)):          # one row tile's state at a time: every key is here
        st = _Rows(q5, i, p, cdt)
        st.add(q5, kk, vv, every, 0, layout, p, scale, softcap, causal, window)
        st.finish(out, lse, sinks)
    return out, lse


class Grads:
    """What the backward of every row tile needs (dO, the logsumexp, ``D = rowsum(dO ∘ O)``) and accumulates
    (dQ in the compute dtype); ``add`` takes one source of keys, as ``_Rows.add`` does in forward."""

    def __init__(self, dout, q, hkv, out, lse):
        b, h, t, d = q.shape
        self.cdt = torch.promote_types(q.dtype, torch.float32)
        self.delta = (dout.to(self.cdt) * out.to(self.cdt)).sum(-1)             # D = rowsum(dO ∘ O), (B, H, T)
        # a row that saw nothing (lse -inf, no sinks) gets P = exp(-inf - inf) = 0, not NaN
        self.lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
        self.dq = torch.zeros((b, h, t, d), dtype=self.cdt, device=q.device)
        self.q5, self.do5 = q.reshape(b, hkv, h // hkv, t, d), dout.reshape(b, hkv, h // hkv, t, d)

    def add(self, i, kk, vv, dkv, js, base, layout, p, scale, softcap, causal, window):
        """Row tile ``i`` against key tiles ``js`` of ``kk``/``vv`` (keys from ``base`` on): its dQ into
        ``self.dq``, the keys' dK/dV into ``dkv`` (2, B, Hkv, keys, D), same offset."""
        b, hkv, rep, _, d = self.q5.shape
        cdt, r = self.cdt, p.rows[i]
        qt, dot = _rows(self.q5, r, cdt), _rows(self.do5, r, cdt)
        tq = qt.shape[2] // rep
        lt = self.lse_b[:, :, r].reshape(b, hkv, rep * tq, 1)
        dt = self.delta[:, :, r].reshape(b, hkv, rep * tq, 1)
        dqt = torch.zeros_like(qt)
        for j in js:
            if p.state[i][j] == SKIP:
                continue
            kr = p.keys[j]
            loc = slice(kr.start - base, kr.stop - base)
            kt, vt = kk[:, :, loc].to(cdt), vv[:, :, loc].to(cdt)
            tile = _tile(layout, p, i, j, qt, kt, (b, hkv, rep, tq), scale, softcap, causal, window)
            pr = torch.exp(tile.scores - lt)
            dkv[1][:, :, loc] += torch.matmul(pr.transpose(-1, -2), dot)
            ds = pr * (torch.matmul(dot, vt.transpose(-1, -2)) - dt)
            if tile.tanh is not None:                 # d(cap·tanh(x/cap))/dx
                ds = ds * (1 - tile.tanh * tile.tanh)
            ds = ds * scale
            dqt += torch.matmul(ds, kt)
            dkv[0][:, :, loc] += torch.matmul(ds.transpose(-1, -2), qt)
        self.dq[:, :, r] += dqt.view(b, hkv, rep, tq, d).reshape(b, -1, tq, d)

    def dsinks(self, sinks, lse):
        if sinks is None:
            return None
        # d out / d sink = -P(sink)·out: dsink = -Σ_rows P(sink)·D
        h = self.dq.shape[1]
        psink = torch.exp(sinks.to(self.cdt).view(1, h, 1) - lse)
        return -(psink * self.delta).sum((0, 2)).to(sinks.dtype)


def _backward(dout, q, kk, vv, out, lse, sinks, layout, p, scale, softcap, causal, window):
    g = Grads(dout, q, kk.shape[1], out, lse)
    dkv = torch.zeros((2,) + tuple(kk.shape), dtype=g.cdt, device=q.device)
    every = range(len(p.keys))
    for i in range(len(p.rows)):
        g.add(i, kk, vv, dkv, every, 0, layout, p, scale, softcap, causal, window)
    return g.dq.to(q.dtype), dkv, g.dsinks(sinks, lse)
