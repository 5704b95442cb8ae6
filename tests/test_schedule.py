"""Backward schedule: what is all-gathered when, and which reductions are still in flight (memory, waits)."""
import torch

import fsdp_plugin as fp
from _dist import run_ranks
from models import GPT, Block, gpt_batch
from fsdp_plugin._flat.flat_param import FlatParamHandle
from fsdp_plugin._schedule.states import ShardedState
from fsdp_plugin._schedule.unit import Unit


def _schedule(rank, world, reshard_after_forward=True):
    torch.manual_seed(0)
    model = fp.shard(GPT(n_layer=3), auto_wrap_policy={Block}, reshard_after_forward=reshard_after_forward)
    root = model._fp_root
    events = []
    gather, pre_bwd, enqueue = FlatParamHandle.unshard, Unit._pre_backward, root.reduction.enqueue

    def spy_gather(h, *a, **k):
        if root.in_backward and h.state is ShardedState.SHARDED:
            events.append(("gather", h.label))
        return gather(h, *a, **k)

    def spy_pre(unit, grad):
        events.append(("pre", unit.name))
        return pre_bwd(unit, grad)

    def spy_enqueue(h, grad, *a, **k):
        events.append(("reduce", h.label, len(root.reduction._pending)))
        return enqueue(h, grad, *a, **k)

    FlatParamHandle.unshard, Unit._pre_backward, root.reduction.enqueue = spy_gather, spy_pre, spy_enqueue
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            events.clear()
            model(*gpt_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        FlatParamHandle.unshard, Unit._pre_backward = gather, pre_bwd
    return events


def test_root_prefetches_last_unit_and_no_reduction_in_flight_at_the_root():
    """The root's backward runs first (its head): it must start the last block's all-gather when the last
    block was resharded after forward (else that all-gather is fully exposed), and the root's big gradient must
    not be assembled while a block's reduction (its full gradient and gloo's copy of it) is still in flight."""
    events = run_ranks(_schedule, 2)[0]
    i_root = events.index(("pre", "<root>"))
    i_gather = events.index(("gather", "blocks.2"))
    i_pre_last = events.index(("pre", "blocks.2"))
    assert i_root < i_gather < i_pre_last, events
    root_reduce = [e for e in events if e[0] == "reduce" and e[1] == "<root>"]
    assert root_reduce == [("reduce", "<root>", 0)], events
    # blocks keep one reduction in flight while the next block computes (overlap)
    assert ("reduce", "blocks.1", 1) in events, events


def test_default_policy_keeps_the_last_unit_from_forward_to_backward():
    """Under the default policy the last block is never resharded between its forward and its backward (the
    second step runs with the order frozen), so backward all-gathers only the blocks before it."""
    events = run_ranks(_schedule, 2, None)[0]
    gathers = [e[1] for e in events if e[0] == "gather"]
    assert gathers == ["blocks.1", "blocks.0"], events
