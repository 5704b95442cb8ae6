"""fp.reset(model) after an exception in the middle of backward: the next steps match single process."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin._schedule.states import ReduceState, ReduceWindow, RootPhase, ShardedState, TrainingState
from _dist import run_ranks
from _parity import global_mean, make_optimizer

D, STEPS, BOOM = 8, 5, 2


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(D, 2)

    def forward(self, x, y, boom=False):
        h = self.inp(x)
        for i, blk in enumerate(self.blocks):
            h = blk(h)
            if boom and i == 1:      # blocks 2 and the head get gradients, blocks 0-1 never do
                h = _RaiseInBackward.apply(h)
        return F.mse_loss(self.head(h), y)


def batch(step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, D, generator=g), torch.randn(4, 2, generator=g)


def reference(world):
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("sgd", model.parameters())
    out = []
    for s in range(STEPS):
        if s == BOOM:
            continue
        xs, ys = zip(*[batch(s, r) for r in range(world)])
        opt.zero_grad()
        loss = model(torch.cat(xs), torch.cat(ys))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def worker(rank, world, strategy, quiet_first):
    torch.manual_seed(0)
    model = fp.shard(Net(), auto_wrap_policy={nn.Sequential}, sharding_strategy=strategy)
    opt = make_optimizer("sgd", model.parameters())
    root = model._fp_root
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        if s == BOOM:
            if quiet_first:       # a no_sync micro-batch whose accumulation the abandoned step must drop
                with fp.no_sync(model):
                    assert root.reduction.window is ReduceWindow.NO_SYNC
                    model(*batch(s, rank)).backward()
                assert root.reduction.window is ReduceWindow.SYNC
            with pytest.raises(RuntimeError, match="boom"):
                model(*batch(s, rank), boom=True).backward()
            assert root.phase is RootPhase.BACKWARD, "the interrupted backward left its phase behind"
            fp.reset(model)
            assert root.phase is RootPhase.IDLE
            assert all(u.state is TrainingState.IDLE for u in root.units)
            assert all(h.state is ShardedState.SHARDED or h._aliases_shard for u in root.units for h in u.handles)
            assert all(hasattr(p, "_fp_handle") for p in model.parameters())
            continue
        loss = model(*batch(s, rank))
        loss.backward()
        opt.step()
        out.append(global_mean(loss, world))
        if s == 0:
            fp.reset(model)       # between steps it changes nothing
    return out, fp.full_state_dict(model)


@pytest.mark.parametrize("world,strategy,quiet_first", [(2, "full_shard", False), (2, "shard_grad_op", True),
                                                         (3, "no_shard", False)])
def test_reset_after_exception_in_backward(world, strategy, quiet_first):
    want_losses, want_state = reference(world)
    results = run_ranks(worker, world, strategy, quiet_first, timeout=120)
    for losses, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
    for k, v in want_state.items():
        assert (results[0][1][k] - v).abs().max().item() <= 1e-5, k


def _failing_reduce_worker(rank, world):
    torch.manual_seed(0)
    model = fp.shard(Net(), auto_wrap_policy={nn.Sequential}, sharding_strategy="full_shard")
    opt = make_optimizer("sgd", model.parameters())
    root = model._fp_root
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        if s == BOOM:   # the root's reduction, finished at the end of backward, raises there
            h = root.root_unit.handles[0]

            def boom(final=True):
                raise RuntimeError("boom in finish_reduce")
            h.finish_reduce = boom
            loss = model(*batch(s, rank))
            with pytest.raises(RuntimeError, match="boom"):
                loss.backward()
            del h.finish_reduce
            agreement = root.reduction._agreement
            assert agreement is not None and agreement.work is not None, "the mask all-reduce was issued"
            assert root.reduction.state is ReduceState.AGREEING
            fp.reset(model)
            assert root.reduction.state is ReduceState.IDLE
            assert root.reduction._agreement is None and agreement.work is None, "fp.reset waited for the mask all-reduce"
            assert all(hh.pending_reduce is None for u in root.units for hh in u.handles)
            continue
        loss = model(*batch(s, rank))
        loss.backward()
        opt.step()
        out.append(global_mean(loss, world))
    return out, fp.full_state_dict(model)


def test_reset_after_a_reduction_raised_at_the_end_of_backward():
    want_losses, want_state = reference(2)
    results = run_ranks(_failing_reduce_worker, 2, timeout=120)
    for losses, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5, (losses, want_losses)
    for k, v in want_state.items():
        assert (results[0][1][k] - v).abs().max().item() <= 1e-5, k
