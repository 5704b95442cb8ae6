"""The ring attention (``context_parallel_attention="ring"``, ``fsdp_plugin/_context/ring.py``) on its own.

cp 2 and 4, fp64, left padding, sliding window, GQA: every rank's output, dQ, dK, dV within 1e-12 of one
whole-sequence SDPA; the bytes and calls per layer against the all-gather attention (the same bytes, C−1
messages per pass); and the K/V it holds: never a tensor of C blocks, at most 2 blocks alive in forward.
(Model-level parity, 4 AdamW steps: ``test_context_parallel.py::test_ring_*``.)
"""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_plugin._context.blockwise import BlockAttention
from fsdp_plugin._context.ring import RingAttention
from fsdp_plugin._context.split import Layout, make_layout

KINDS = ("cp_kv", "cp_kv_bwd", "reduce_scatter", "cp_kv_ring", "cp_kv_ring_bwd", "cp_dkv_ring")


class _Blocks(TorchDispatchMode):
    """Stacked K/V-shaped tensors (5-D, first dim 2) the ops produce: the largest (elements) and the most
    alive at once."""

    def __init__(self):
        super().__init__()
        self.largest, self.alive, self.refs = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() == 5 and t.shape[0] == 2:
                self.largest = max(self.largest, t.numel())
                self.refs.append(weakref.ref(t))
        self.alive = max(self.alive, sum(r() is not None for r in self.refs))
        return out


def _worker(rank, world, seq, heads):
    import fsdp_plugin as fp
    from transformers.masking_utils import find_packed_sequence_indices
    h, hkv, d = heads
    mask2d = torch.ones(1, seq, dtype=torch.long)
    mask2d[0, :3] = 0
    results = {}
    for name, fn in (("allgather", BlockAttention), ("ring", RingAttention)):
        lay = make_layout(torch.distributed.group.WORLD, world, rank, 1, seq, mask2d, None,
                          find_packed_sequence_indices, name)
        lay.block = 3
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, n, lay.padded, d, generator=g, dtype=torch.float64) for n in (h, hkv, hkv)]
        mine = [x[:, :, lay.q_index].clone().requires_grad_() for x in full]
        before = {k: (fp.comm_stats.calls[k], fp.comm_stats.bytes[k]) for k in KINDS}
        with _Blocks() as fwd:
            out = fn.apply(*mine, None, lay, 0.5, None, True, 5)
        with _Blocks() as bwd:
            grads = torch.autograd.grad(out, mine, torch.ones_like(out))
        ref = [x.clone().requires_grad_() for x in full]
        order = torch.arange(lay.padded)
        one = Layout(None, 1, 0, seq, lay.padded, order, order, F.pad(mask2d.bool(), (0, lay.padded - seq)))
        want = F.scaled_dot_product_attention(*ref, attn_mask=one.mask(True, 5, "cpu"), scale=0.5, enable_gqa=True)
        wgrads = torch.autograd.grad(want, ref, torch.ones_like(want))
        errs = [(out - want[:, :, lay.q_index]).abs().max().item()]
        errs += [(a - b[:, :, lay.q_index]).abs().max().item() for a, b in zip(grads, wgrads)]
        moved = {k: (fp.comm_stats.calls[k] - c, fp.comm_stats.bytes[k] - b) for k, (c, b) in before.items()}
        block = 2 * hkv * lay.q_index.numel() * d
        results[name] = (errs, moved, fwd.largest // block, fwd.alive, bwd.largest // block)
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_one_process_moves_allgather_bytes_and_holds_two_blocks(cp):
    """seq 29 (padded to 32), window 5, left padding, GQA 4/2 in fp64; one attention layer, forward + backward.
    Bytes: the ring's K/V rotations equal the all-gather's K/V bytes in forward and in backward, and its dK/dV
    hops the reduce-scatter's, in C−1 calls each (the all-gather mode: 1). Memory: the all-gather attention
    makes a C-block K/V tensor; the ring's largest K/V-shaped tensor is one block, 2 alive in forward."""
    for res in run_ranks(_worker, cp, 29, (4, 2, 8), timeout=120):
        (g_errs, g_moved, g_big, _, _), (errs, moved, big, alive, bwd_big) = res["allgather"], res["ring"]
        assert max(errs) <= 1e-12 and max(g_errs) <= 1e-12, (errs, g_errs)
        assert moved["cp_kv_ring"] == (cp - 1, g_moved["cp_kv"][1]), (moved, g_moved)
        assert moved["cp_kv_ring_bwd"] == (cp - 1, g_moved["cp_kv_bwd"][1])
        assert moved["cp_dkv_ring"] == (cp - 1, g_moved["reduce_scatter"][1])
        assert g_moved["cp_kv"][0] == 1 and g_moved["cp_kv"][1] > 0
        for kind in ("cp_kv", "cp_kv_bwd", "reduce_scatter"):
            assert moved[kind] == (0, 0), moved        # the ring never gathers
        assert g_big == cp                              # the all-gather holds every rank's block
        assert (big, alive, bwd_big) == (1, 2, 1), (big, alive, bwd_big)
