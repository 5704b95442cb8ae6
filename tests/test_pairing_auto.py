"""Issue 30: the pairing check never makes the host wait for other ranks before a unit collective.

``fp.sync_stats`` counts host-blocking cross-rank waits: per step exactly the one control all-reduce (the
unused-parameter mask) for every strategy on gloo, at world 2 and 4 alike. Where tags do not apply (NCCL) the
ledger hash rides in that all-reduce: forced here on gloo with a divergence of equal sizes (the only kind a
native gloo collective survives), it is a CollectiveError at the end of backward on every rank, before any
optimizer step, and fp.reset recovers."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_plugin as fp
from _dist import run_ranks
from test_pairing import Block, D, Net, Tower


def _waits(rank, world, strategy, check="auto", steps=3):
    torch.manual_seed(0)
    mesh = (2, world // 2) if strategy == "hybrid_shard" else None
    model = fp.shard(Net("tower", at=99), auto_wrap_policy={Block, Tower}, sharding_strategy=strategy,
                     device_mesh=mesh, pairing_check=check)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(steps):
        fp.sync_stats.reset()
        opt.zero_grad()
        model(torch.randn(4, D, generator=torch.Generator().manual_seed(step + rank))).backward()
        opt.step()
        per_step.append(dict(fp.sync_stats.waits))
    return per_step


STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_blocking_wait_per_step_and_none_per_unit(strategy):
    worlds = [4] if strategy == "hybrid_shard" else [2, 4]
    for world in worlds:
        for rank, steps in enumerate(run_ranks(_waits, world, strategy, timeout=120)):
            assert all(s == {"control": 1} for s in steps), (world, rank, steps)


def test_strict_waits_once_per_native_collective():
    steps = run_ranks(_waits, 2, "no_shard", "strict", timeout=120)[0]
    # 4 reductions announced before issue + the end-of-backward announcement, then the mask
    assert steps[-1] == {"pairing": 5, "control": 1}, steps


def _hashed(rank, world, mode, check_steps=4):
    """The ledger-hash path (NCCL's) on gloo: rank 0 swaps two equal-sized blocks at step 1 only."""
    from fsdp_plugin._schedule import root as root_mod
    root_mod.pairing_mode = lambda config, mesh, device: "hash"
    torch.manual_seed(0)
    model = fp.shard(Net(mode, at=1, once=True), auto_wrap_policy={Block, Tower}, timeout_s=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(check_steps):
        model.step = step
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        fp.sync_stats.reset()
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            model(x).backward()
        except fp.CollectiveError as e:
            errors.append((step, str(e), dict(fp.sync_stats.waits)))
            fp.reset(model)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            continue
        assert fp.sync_stats.waits == {"control": 1}, fp.sync_stats.waits
        opt.step()
    model.step = 99
    with torch.no_grad():
        loss = model(torch.ones(4, D)).reshape(1)
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, loss)
    return errors, [t.item() for t in losses]


def test_ledger_hash_raises_at_the_end_of_backward_on_every_rank_and_fp_reset_recovers():
    for rank, (errors, losses) in enumerate(run_ranks(_hashed, 2, "swap", timeout=120)):
        assert [step for step, _, _ in errors] == [1], (rank, errors)
        message = errors[0][1]
        assert "ranks diverged" in message and "rank 0: " in message and "rank 1: " in message, message
        assert "blocks.1" in message and "blocks.0" in message, message
        assert losses[0] == losses[1], losses


def test_check_off_trains_without_any_pairing_message():
    steps = run_ranks(_waits, 2, "full_shard", "off", timeout=120)[0]
    assert all(s == {"control": 1} for s in steps), steps


def _tagged_all_reduce(rank, world, numel):
    from fsdp_plugin._comm import collectives as comm, tagged
    t = torch.arange(numel, dtype=torch.float32) * (rank + 1) + 0.1 * rank
    work = comm.all_reduce(t, None, async_op=True, gate=comm.Tagged(tagged.code(1, 0, 0, 0)))
    assert isinstance(work, comm._P2PPairSum if world == 2 else comm._P2PAllReduce)
    comm.wait(work, "test")
    return t


@pytest.mark.parametrize("world,numel", [(2, 7), (3, 10), (4, 3)])
def test_tagged_all_reduce_sums_every_rank_in_rank_order(world, numel):
    results = run_ranks(_tagged_all_reduce, world, numel, timeout=60)
    want = torch.zeros(numel)
    for r in range(world):
        want = want + (torch.arange(numel, dtype=torch.float32) * (r + 1) + 0.1 * r)
    for t in results:
        assert torch.equal(t, results[0])          # the same bits on every rank
        assert torch.allclose(t, want, atol=1e-6), (t, want)
