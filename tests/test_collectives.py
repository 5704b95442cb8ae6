"""`_collectives.reduce_scatter` on gloo: point-to-point exchange, equal to a reduction of every rank's input,
in the world group and in a subgroup, with several reductions in flight and a deadline on the wait."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from fsdp_plugin._comm import collectives as comm


def _inputs(rank: int, world: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(numel * world, generator=g) * (k + 1) for k in range(3)]


def _reduce_scatter_in_flight(rank, world, numel):
    group = None
    if world == 3:   # a subgroup whose ranks are not 0..n-1 of the world: ranks 1 and 2
        group = dist.new_group([1, 2])
        if rank == 0:
            return None
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    inputs = _inputs(rank, n, numel)
    outs = [torch.empty(numel) for _ in inputs]
    works = [comm.reduce_scatter(o, i, group, async_op=True) for o, i in zip(outs, inputs)]
    assert isinstance(works[0], comm._P2PReduceScatter), "gloo + CPU must take the point-to-point path"
    for w in reversed(works):          # waited out of issue order: each has its own tag
        comm.wait(w, "test reduce-scatter", 30)
    members = [1, 2] if world == 3 else list(range(world))
    want = [sum(_inputs(r, n, numel)[k] for r in members).view(n, -1)[me] for k in range(3)]
    sync_out = torch.empty(numel)
    comm.reduce_scatter(sync_out, inputs[0], group)      # blocking form
    return [(o - w).abs().max().item() for o, w in zip(outs + [sync_out], want + [want[0]])]


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_reduce_scatter_matches_the_sum(world):
    results = run_ranks(_reduce_scatter_in_flight, world, 1000, timeout=60)
    for r in results:
        if r is not None:
            assert max(r) <= 1e-5 if world == 3 else max(r) == 0.0, r


def _all_gather(rank, world):
    group = None
    if world == 3:
        group = dist.new_group([1, 2])
        if rank == 0:
            return None
    n, me = dist.get_world_size(group), dist.get_rank(group)
    members = [1, 2] if world == 3 else list(range(world))
    mine = [torch.arange(5.0) + 100 * rank + k for k in range(2)]
    outs = [torch.empty(5 * n) for _ in mine]
    works = [comm.all_gather(o, i, group, async_op=True) for o, i in zip(outs, mine)]
    assert isinstance(works[0], comm._P2PAllGather)
    for w in reversed(works):
        comm.wait(w, "test all-gather", 30)
    want = [torch.cat([torch.arange(5.0) + 100 * r + k for r in members]) for k in range(2)]
    assert me == members.index(rank)
    return all(torch.equal(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_all_gather_in_rank_order(world):
    assert all(r in (None, True) for r in run_ranks(_all_gather, world, timeout=60))
