"""Uneven inputs: ``torch.distributed.algorithms.Join([sharded_model])`` gives DDP + Join's result.

Ranks get different numbers of batches; a rank out of batches shadows the others' steps (its shard is
all-gathered and stepped every step). Reference: DDP + Join on the same data in the same processes
(``divide_by_initial_world_size`` both ways), compared at the end within 1e-5; SGD with momentum and AdamW,
clipping on, a learning-rate schedule that moves every step (the joined ranks must follow it).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

import fsdp_plugin as fp
from _dist import run_ranks


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(rank: int, n: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def make_opt(kind: str, params):
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def train(model, clip, data, opt_kind: str, divide: bool) -> None:
    opt, sched = make_opt(opt_kind, model.parameters())
    with Join([model], divide_by_initial_world_size=divide):
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            clip(model.parameters(), 0.3 if divide else 10.0)   # clipping would hide the divisor
            opt.step()
            sched.step()


def _both(rank, world, counts, opt_kind, divide, sharding=None):
    data = batches(rank, counts[rank])
    ddp = nn.parallel.DistributedDataParallel(build())
    train(ddp, nn.utils.clip_grad_norm_, data, opt_kind, divide)
    want = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    model = fp.shard(build(), auto_wrap_policy={nn.Linear}, **(sharding or {}))
    train(model, fp.clip_grad_norm_, data, opt_kind, divide)
    with fp.full_params(model, writeback=False):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return want, got, fp.comm_stats.snapshot()["calls"]


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
@pytest.mark.parametrize("divide", [True, False])
def test_join_matches_ddp_join(opt_kind, divide):
    for want, got, _ in run_ranks(_both, 2, (5, 3), opt_kind, divide, timeout=120):
        assert set(want) == set(got)
        err = max((want[k] - got[k]).abs().max().item() for k in want)
        assert err <= 1e-5, err
        moved = max((want[k] - build().state_dict()[k]).abs().max().item() for k in want)
        assert moved > 1e-2, moved      # the comparison is not between two untouched models


def test_join_three_ranks_with_three_counts():
    results = run_ranks(_both, 3, (2, 5, 3), "sgd", False, timeout=120)
    for want, got, _ in results:
        assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard", "hybrid_shard"])
def test_join_with_other_strategies(strategy):
    sharding = {"sharding_strategy": strategy, **({"device_mesh": (2, 1)} if strategy == "hybrid_shard" else {})}
    for want, got, _ in run_ranks(_both, 2, (5, 3), "sgd", False, sharding, timeout=120):
        assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5


def _joins_without_a_batch(rank, world):
    model = fp.shard(build(), auto_wrap_policy={nn.Linear}, timeout_s=4)   # rank 0 then waits in vain
    try:
        train(model, fp.clip_grad_norm_, batches(rank, 2 if rank == 0 else 0), "sgd", True)
    except fp.FSDPPluginError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_rank_without_any_batch_gets_a_clear_error():
    cls, msg = run_ranks(_joins_without_a_batch, 2, timeout=60, may_die={0})[1]
    assert cls == "UsageError" and "at least one batch" in msg, msg


ACCELERATE_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                  "FSDP_SYNC_MODULE_STATES": "false", "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
                  "FSDP_MIN_NUM_PARAMS": "1", "FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "full_shard",
                  "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "ACCELERATE_MIXED_PRECISION": "no",
                  "MASTER_ADDR": "localhost", "MASTER_PORT": "0"}


def _accelerate_join(rank, world, counts):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator

    data = batches(rank, counts[rank])
    ddp = nn.parallel.DistributedDataParallel(build())
    train(ddp, nn.utils.clip_grad_norm_, data, "adamw", True)
    want = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    acc = Accelerator()
    net = build()
    opt, sched = make_opt("adamw", net.parameters())
    model, opt = acc.prepare(net, opt)
    with acc.join_uneven_inputs([model], even_batches=False):
        for x, y in data:
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(model(x), y))
            acc.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
            sched.step()
    with fp.full_params(model, writeback=False):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return want, got


def test_accelerate_join_uneven_inputs_matches_ddp_join():
    pytest.importorskip("accelerate")
    for want, got in run_ranks(_accelerate_join, 2, (5, 3), env=ACCELERATE_ENV, timeout=120):
        assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5


def _accumulating(rank, world, counts):
    """Two micro-batches per optimizer step (no_sync on the first); a joined rank shadows both kinds."""
    import contextlib

    def loop(model, no_sync, clip):
        opt, sched = make_opt("sgd", model.parameters())
        with Join([model], divide_by_initial_world_size=False):
            for i, (x, y) in enumerate(batches(rank, counts[rank])):
                with no_sync(model) if i % 2 == 0 else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x), y).backward()
                if i % 2 == 1:
                    clip(model.parameters(), 10.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()

    ddp = nn.parallel.DistributedDataParallel(build())
    loop(ddp, lambda m: m.no_sync(), nn.utils.clip_grad_norm_)
    model = fp.shard(build(), auto_wrap_policy={nn.Linear})
    loop(model, fp.no_sync, fp.clip_grad_norm_)
    with fp.full_params(model, writeback=False):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}, got


def test_join_with_gradient_accumulation_matches_ddp_join():
    for want, got in run_ranks(_accumulating, 2, (6, 2), timeout=120):
        assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5


def _disagree_on_stepping(rank, world):
    from fsdp_plugin._schedule.join import state_of

    model = fp.shard(build(), auto_wrap_policy={nn.Linear})
    state_of(model).accumulating = rank == 0   # rank 0: an accumulation micro-batch; rank 1 will step
    try:
        with Join([model]):
            x, y = batches(rank, 1)[0]
            nn.functional.mse_loss(model(x), y).backward()
    except fp.FSDPPluginError as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_ranks_that_disagree_about_stepping_get_a_clear_error_on_every_rank():
    """A partial last accumulation window on one rank (Lightning steps on each rank's final batch)."""
    for cls, msg in run_ranks(_disagree_on_stepping, 2, timeout=60):
        assert cls == "UsageError" and "1 step the optimizers" in msg and "multiple" in msg, msg
