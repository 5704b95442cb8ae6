"""Every step's collective pairing is checked (issue 26): a unit that runs, or reaches the loss, on some ranks
only — from any step on — raises CollectiveError on every rank naming what each rank was entering, instead of
a gloo abort (SIGABRT) or, on NCCL, two units exchanging each other's data."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks

D = 8


class Block(nn.Module):
    def __init__(self, d_out: int = D):
        super().__init__()
        self.lin = nn.Linear(D, d_out)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Tower(Block):
    """A unit of its own (a vision tower, say), not the same size as a Block."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(D, D)

    def forward(self, x):
        return super().forward(self.extra(x))


class Net(nn.Module):
    """``mode`` decides, per step and rank, how the ranks diverge from step ``at`` on (at step ``at`` only
    with ``once``): "tower": rank 0 runs the tower, rank 1 does not; "unused": both run it, only rank 0's loss
    uses it; "swap": rank 0 runs the two (equal-sized) blocks in reverse order; "order": rank 0 runs the tower
    (a different size) before the blocks, so its all-gather meets another unit's."""

    def __init__(self, mode: str, at: int, once: bool = False):
        super().__init__()
        self.mode, self.at, self.once, self.step = mode, at, once, 0
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.tower = Tower()

    def forward(self, x):
        odd = (self.step == self.at if self.once else self.step >= self.at) and dist.get_rank() == 0
        h = self.inp(x)
        if self.mode == "order" and odd:
            h = self.tower(h)
        blocks = reversed(self.blocks) if self.mode == "swap" and odd else self.blocks
        for blk in blocks:
            h = blk(h)
        if self.mode == "order":
            return self.head(h if odd else self.tower(h)).pow(2).mean()
        t = self.tower(h) if self.mode != "tower" or odd or self.step < self.at else None
        use_tower = t is not None and (self.mode != "unused" or odd or self.step < self.at)
        return self.head(h + t if use_tower else h).pow(2).mean()


def _train(rank, world, mode, strategy, at=1, steps=3):
    torch.manual_seed(0)
    model = fp.shard(Net(mode, at), auto_wrap_policy={Block, Tower}, sharding_strategy=strategy, timeout_s=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model.step = step
        opt.zero_grad()
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            model(x).backward()
        except fp.CollectiveError as e:
            fp.reset(model)          # every check paired: nothing is left in flight, the groups still work
            dist.barrier()
            return step, str(e)
        opt.step()
    return steps, "no error"


CASES = [("tower", "full_shard", "tower"), ("tower", "no_shard", "tower"), ("unused", "full_shard", "tower"),
         ("unused", "no_shard", "tower"), ("swap", "full_shard", "blocks."), ("order", "full_shard", "tower"),
         ("order", "shard_grad_op", "tower")]


@pytest.mark.parametrize("mode,strategy,named", CASES, ids=[f"{m}-{s}" for m, s, _ in CASES])
def test_divergence_after_the_first_step_is_a_collective_error_on_every_rank(mode, strategy, named):
    for rank, (step, message) in enumerate(run_ranks(_train, 2, mode, strategy, timeout=90)):
        assert step == 1, (rank, step, message)
        assert "ranks diverged" in message and named in message, message
        assert "rank 0: " in message and "rank 1: " in message, message


def _steady(rank, world, strategy="full_shard", check="auto"):
    torch.manual_seed(0)
    model = fp.shard(Net("tower", at=10), auto_wrap_policy={Block, Tower}, sharding_strategy=strategy,
                     pairing_check=check)
    for step in range(3):
        model.step = step
        fp.comm_stats.reset()
        model(torch.randn(4, D)).backward()
    return dict(fp.comm_stats.calls)


def test_agreeing_ranks_send_no_pairing_message_on_gloo():
    calls = run_ranks(_steady, 2)[0]
    # per step: root + 2 blocks + tower all-gathered in forward, blocks.0/blocks.1/tower again in backward
    # (the last unit is kept), 4 reductions; their tags carry the check: the only control collective is the
    # unused-parameter mask
    assert (calls["all_gather"], calls["reduce_scatter"], calls["control"]) == (6, 4, 1), calls


def test_strict_announces_native_collectives_one_check_each():
    calls = run_ranks(_steady, 2, "no_shard", "strict")[0]
    # no_shard under "strict": gloo's own all-reduce per unit (4), each announced before it is issued; plus end
    # of backward and the unused-parameter mask
    assert calls["all_reduce"] + 2 == calls["control"], calls


def test_no_shard_reductions_are_tagged_too_by_default():
    calls = run_ranks(_steady, 2, "no_shard")[0]
    # issue 30: no_shard's all-reduces are tagged point to point on gloo: the only control collective is the mask
    assert (calls["all_reduce"], calls["control"]) == (4, 1), calls


def _recover(rank, world, mode, strategy):
    """Diverge at step 1 only, fp.reset, train two more steps: the same loss on every rank at the end."""
    torch.manual_seed(0)
    model = fp.shard(Net(mode, at=1, once=True), auto_wrap_policy={Block, Tower}, sharding_strategy=strategy,
                     timeout_s=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    errors = []
    for step in range(4):
        model.step = step
        opt.zero_grad()
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            model(x).backward()
        except fp.CollectiveError as e:
            errors.append((step, str(e)))
            fp.reset(model)
            continue
        opt.step()
    model.step = 99
    with torch.no_grad():
        loss = model(torch.ones(4, D)).reshape(1)
    losses = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(losses, loss)
    return errors, [t.item() for t in losses]


@pytest.mark.parametrize("mode", ["tower", "unused", "swap", "order"])
def test_after_a_divergence_fp_reset_realigns_and_training_goes_on(mode):
    for rank, (errors, losses) in enumerate(run_ranks(_recover, 2, mode, "full_shard", timeout=90)):
        assert [step for step, _ in errors] == [1], (rank, errors)
        assert "ranks diverged" in errors[0][1], errors
        assert losses[0] == losses[1], losses      # the shards still pair: both ranks see the same model


@pytest.mark.parametrize("mode,world", [("tower", 2), ("unused", 2), ("order", 2), ("tower", 3)])
def test_no_shard_divergence_with_phase_two_reserved_recovers(mode, world):
    # issue 30: at world 3 a tagged all-reduce reserves its phase 2's position at issue and posts its sends a unit
    # later; a rank that diverged complements them, and fp.reset posts any still unposted, so every rank drains.
    # At world 2 it is the pair sum (one position, whole tensors): its complements likewise
    for rank, (errors, losses) in enumerate(run_ranks(_recover, world, mode, "no_shard", timeout=90)):
        assert [step for step, _ in errors] == [1], (rank, errors)
        assert "ranks diverged" in errors[0][1], errors
        assert len(set(losses)) == 1, losses


def test_a_divergence_among_three_ranks_is_named_on_every_rank_and_fp_reset_recovers():
    results = run_ranks(_recover, 3, "tower", "full_shard", timeout=90)
    for rank, (errors, losses) in enumerate(results):
        assert [step for step, _ in errors] == [1], (rank, errors)
        assert all(f"rank {r}: " in errors[0][1] for r in range(3)), errors
        assert len(set(losses)) == 1, losses


def _slow_rank(rank, world):
    """Rank 1 is late by several probe periods before one step: a long wait, not a divergence."""
    import time

    from fsdp_plugin._comm import tagged
    torch.manual_seed(0)
    model = fp.shard(Net("tower", at=10), auto_wrap_policy={Block, Tower}, timeout_s=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model.step = step
        if step == 1 and rank == 1:
            time.sleep(6 * tagged.PROBE_AFTER_S)
        opt.zero_grad()
        model(torch.randn(4, D, generator=torch.Generator().manual_seed(step + rank))).backward()
        opt.step()
    with torch.no_grad():
        return model(torch.ones(4, D)).item()


def test_a_late_rank_is_not_a_divergence():
    losses = run_ranks(_slow_rank, 2, timeout=90)
    assert losses[0] == losses[1], losses
