"""The tiled all-gather attention (``fsdp_plugin/_context/blockwise.py``) against whole-mask attention.

Single process: a CP group of one (no collective) whose positions are a random permutation of the padded
sequence, tiles of 3 (chunks of 8 cut 3, 3, 2), fp64, forward and every gradient within 1e-12 of
``F.scaled_dot_product_attention`` with the whole bool mask, or of transformers' eager formula (sinks,
soft-capping) computed in fp64. Two ranks: the gather, the re-gather in backward and the reduce-scatter.
Memory: no tensor of (local x sequence) size exists in forward + backward (the whole-mask code makes one).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_plugin._context.attention import _attend
from fsdp_plugin._context.blockwise import BlockAttention, _gather
from fsdp_plugin._context.split import Layout, make_layout
from fsdp_plugin._context.tiles import FULL, PART, SKIP, plan

SEQ, PADDED, BATCH, D = 13, 16, 2, 8


def _layout(valid=None, doc=None, block=3, seed=0):
    order = torch.randperm(PADDED, generator=torch.Generator().manual_seed(seed))
    keys = torch.ones(BATCH, PADDED, dtype=torch.bool)
    keys[:, SEQ:] = False                          # the split's padding: 13 tokens padded to 16
    if valid is not None:
        keys &= valid
    return Layout(None, 1, 0, SEQ, PADDED, order, order, keys, doc, block=block)


def _left_padded():
    valid = torch.ones(BATCH, PADDED, dtype=torch.bool)
    valid[1, :4] = False
    return valid


def _packed():
    doc = torch.zeros(BATCH, PADDED, dtype=torch.long)
    doc[0, 6:] = 1
    doc[:, SEQ:] = -1
    return doc


def _eager(q, k, v, mask, scale, sinks, softcap, real):
    """transformers' eager attention (dtype-minimum additive mask, sinks as an extra column), softmax in fp64;
    the split's padded keys (``~real``) get -inf."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    logits = logits + bias.masked_fill(~real, float("-inf"))
    if sinks is None:
        return F.softmax(logits, -1) @ v
    both = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)], -1)
    return F.softmax(both - both.amax(-1, keepdim=True), -1)[..., :-1] @ v


CASES = {      # causal, window, valid keys, documents, (H, Hkv), sinks, softcap
    "causal_gqa": (True, None, None, None, (4, 2), False, None),
    "causal_mha": (True, None, None, None, (2, 2), False, None),
    "sliding": (True, 5, None, None, (4, 2), False, None),
    "left_padding": (True, None, _left_padded(), None, (4, 2), False, None),    # rows that see nothing: 0
    "packed": (True, None, None, _packed(), (4, 1), False, None),
    "bidirectional_padding": (False, None, _left_padded(), None, (4, 2), False, None),
    "sinks": (True, 5, _left_padded(), None, (4, 2), True, None),
    "softcap": (True, None, _left_padded(), None, (4, 2), False, 0.5),     # rows that see nothing: uniform
    "softcap_sinks": (True, 5, _left_padded(), None, (4, 2), True, 0.5),
}


def _inputs(h, hkv, sinks, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, h, PADDED, D, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(BATCH, hkv, PADDED, D, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(BATCH, hkv, PADDED, D, generator=g, dtype=dtype).requires_grad_()
    s = torch.randn(h, generator=g, dtype=dtype).requires_grad_() if sinks else None
    return q, k, v, s


@pytest.mark.parametrize("name", list(CASES))
def test_tiles_match_whole_mask_attention_fp64(name):
    causal, window, valid, doc, (h, hkv), with_sinks, softcap = CASES[name]
    lay = _layout(valid, doc)
    q, k, v, sinks = _inputs(h, hkv, with_sinks)
    scale = D ** -0.5
    got = BlockAttention.apply(q, k, v, sinks, lay, scale, softcap, causal, window)
    mask = lay.mask(causal, window, "cpu")
    if sinks is None and softcap is None:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hkv)
    else:
        want = _eager(q, k, v, mask, scale, sinks, softcap, (lay.kv_index < SEQ).view(1, 1, 1, -1))
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=got.dtype)
    ins = [x for x in (q, k, v, sinks) if x is not None]
    for a, b in zip((got, *torch.autograd.grad(got, ins, grad)), (want, *torch.autograd.grad(want, ins, grad))):
        assert (a - b).abs().max().item() <= 1e-12, name
    # not vacuous: the mask masks, and the causal padded cases have queries that see no key
    assert not mask.all() and (valid is None or not causal or (~mask.any(-1)).any())
    states = {s for line in plan(lay, causal, window, softcap is not None and not with_sinks).state for s in line}
    assert PART in states and (FULL in states or not causal or window or doc is not None or valid is not None)


def test_causal_tiles_skip_and_need_no_mask():
    """Under a causal mask in sequence order, tiles above the diagonal are skipped and those below take no mask;
    a tile that would need a mask but is marked FULL would be caught by the fp64 tests above."""
    lay = Layout(None, 1, 0, 16, 16, torch.arange(16), torch.arange(16), torch.ones(1, 16, dtype=torch.bool),
                 block=4)
    states = plan(lay, True, None, False).state
    assert states == [[PART, SKIP, SKIP, SKIP], [FULL, PART, SKIP, SKIP], [FULL, FULL, PART, SKIP],
                      [FULL, FULL, FULL, PART]]


def test_rows_that_see_nothing_match_the_whole_mask_kernel_fp32():
    """What the model tests check against one process, here directly: the previous whole-mask kernel (SDPA,
    eager soft-capping, sinks) and the tiles agree in fp32 on left-padded rows too (eager's softmax runs in
    fp32 there, so fp64 cannot use it)."""
    for sinks, softcap in ((False, None), (False, 0.5), (True, None), (True, 0.5)):
        lay = _layout(_left_padded())
        q, k, v, s = _inputs(4, 2, sinks, torch.float32)
        got = BlockAttention.apply(q, k, v, s, lay, 0.3, softcap, True, None)
        want = _attend(q, k, v, lay.mask(True, None, "cpu"), 0.3, s, softcap, lay.kv_index >= SEQ)
        ins = [x for x in (q, k, v, s) if x is not None]
        grad = torch.ones_like(got)
        for a, b in zip((got, *torch.autograd.grad(got, ins, grad)), (want, *torch.autograd.grad(want, ins, grad))):
            assert (a - b).abs().max().item() <= 1e-5, (sinks, softcap)


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _cp_worker(rank, world, seq, block, heads):
    """Two ranks, fp64: this rank's rows of the output and of dQ, and its keys' dK/dV (summed over both ranks'
    queries by the reduce-scatter), against one whole-sequence attention; the K/V collectives per pass; and the
    largest tensor of the tiled forward + backward against the whole-mask code's."""
    import fsdp_plugin as fp
    from transformers.masking_utils import find_packed_sequence_indices
    h, hkv, d = heads
    mask2d = torch.ones(1, seq, dtype=torch.long)
    mask2d[0, :3] = 0
    lay = make_layout(torch.distributed.group.WORLD, world, rank, 1, seq, mask2d, None, find_packed_sequence_indices)
    lay.block = block
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, lay.padded, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)]
    mine = [x[:, :, lay.q_index].clone().requires_grad_() for x in full]
    ref = [x.clone().requires_grad_() for x in full]
    before = dict(fp.comm_stats.calls)
    with _Largest() as tiled:
        out = BlockAttention.apply(*mine, None, lay, 0.5, None, True, 3)
        grads = torch.autograd.grad(out, mine, torch.ones_like(out))
    calls = {k: fp.comm_stats.calls[k] - before.get(k, 0) for k in ("cp_kv", "cp_kv_bwd")}
    order = torch.arange(lay.padded)     # the reference: sequence order, the same padded length
    one = Layout(None, 1, 0, seq, lay.padded, order, order, F.pad(mask2d.bool(), (0, lay.padded - seq)))
    want = F.scaled_dot_product_attention(*ref, attn_mask=one.mask(True, 3, "cpu"), scale=0.5, enable_gqa=True)
    wgrads = torch.autograd.grad(want, ref, torch.ones_like(want))
    errs = [(out - want[:, :, lay.q_index]).abs().max().item()]
    errs += [(a - b[:, :, lay.q_index]).abs().max().item() for a, b in zip(grads, wgrads)]
    # the whole-mask code this replaced: one SDPA over the gathered K/V with the (local x S) mask
    q = mine[0].detach().requires_grad_()
    kv = _gather(mine[1].detach(), mine[2].detach(), lay, "cp_kv").requires_grad_()
    lay._masks.clear()
    with _Largest() as whole:
        old = _attend(q, kv[0], kv[1], lay.mask(True, 3, "cpu"), 0.5)
        torch.autograd.grad(old, (q, kv), torch.ones_like(old))
    return errs, calls, tiled.largest, whole.largest, lay.q_index.numel(), lay.padded


def test_two_ranks_gather_rescatter_and_match_one_process():
    """cp 2, seq 29 (padded to 32, left padding, window 3, GQA 4/2): every rank's output, dQ, dK, dV within
    1e-12 of one whole-sequence SDPA; one K/V all-gather in forward and one in backward."""
    for errs, calls, *_ in run_ranks(_cp_worker, 2, 29, 3, (4, 2, 8), timeout=120):
        assert max(errs) <= 1e-12, errs
        assert calls == {"cp_kv": 1, "cp_kv_bwd": 1}, calls


def test_no_tensor_of_local_by_sequence_size():
    """cp 2, seq 64, tiles of 16, 2 query heads over 1 K/V head of width 4 (so that the gathered K/V, S·2·d,
    stay below T_local·S): the largest tensor the tiled forward + backward produce is at most a quarter of
    T_local x S elements (tiles: 2·16·16); the whole-mask code's is at least T_local x S (its mask)."""
    for _, _, tiled, whole, local, seq in run_ranks(_cp_worker, 2, 64, 16, (2, 1, 4), timeout=120):
        assert tiled <= local * seq // 4, (tiled, local * seq)
        assert whole >= local * seq, (whole, local * seq)


@pytest.mark.parametrize("cp", [2, 4])
def test_range_classification_is_exact_or_conservative(cp, monkeypatch):
    """The split's tiles (consecutive positions) are classified from position ranges, key validity and
    document ranges without building their masks: every SKIP / FULL it gives is what the tile's mask says
    (PART is always safe), and under a plain causal or windowed mask it is exactly the masks' answer."""
    from transformers.masking_utils import find_packed_sequence_indices

    from fsdp_plugin._context import tiles
    seq = 29
    left = torch.ones(2, seq, dtype=torch.long)
    left[1, :5] = 0
    packed = torch.arange(seq).repeat(2, 1)
    packed[0, 10:], packed[0, 20:] = torch.arange(seq - 10), torch.arange(seq - 20)
    scan = tiles.scan
    monkeypatch.setattr(tiles, "scan", None)      # the split's layouts must never need the mask scan
    parts = total = 0
    for rank in range(cp):
        for mask2d, pos in ((None, None), (left, None), (None, packed)):
            lay = make_layout(None, cp, rank, 2, seq, mask2d, pos, find_packed_sequence_indices)
            lay.block = 3
            for causal, window in ((True, None), (True, 4), (False, None), (False, 4)):
                fast = plan(lay, causal, window, False)
                exact, _ = scan(lay, causal, window, fast.rows, fast.keys)
                for f_line, e_line in zip(fast.state, exact):
                    assert all(f == e or f == PART for f, e in zip(f_line, e_line))
                    parts += sum(f != e for f, e in zip(f_line, e_line))
                    total += len(f_line)
                if mask2d is None and pos is None:
                    assert fast.state == exact
    assert parts <= total // 10, (parts, total)      # conservative answers stay rare
