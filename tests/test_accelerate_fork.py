"""The Accelerator on 2 forked gloo ranks (no launcher): every strategy the config can select.

Cheap complement to test_accelerate_launch.py: the env is what ``accelerate launch`` exports (see
test_accelerate_config.py), the process group comes from the fork harness, and accelerate adopts it.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from _dist import run_ranks

ACCUM, MICRO, BATCH = 2, 4, 8
BASE = {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_SYNC_MODULE_STATES": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
        "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "ACCELERATE_MIXED_PRECISION": "no",
        "MASTER_ADDR": "localhost", "MASTER_PORT": "0"}
CASES = {
    "v1_full_shard": ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "full_shard"}, "full_shard", None),
    "v1_shard_grad_op": ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op"}, "shard_grad_op", None),
    "v1_no_shard": ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_SHARDING_STRATEGY": "NO_SHARD"},
                    "no_shard", None),
    "v2_parallelism_hybrid": ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
                               "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                               "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}, "hybrid_shard", (2, 1)),
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(MICRO, BATCH, 4, generator=g), torch.randn(MICRO, BATCH, 1, generator=g)


def reference() -> list[float]:
    model, opt = build()
    xs, ys = data()
    losses = []
    for i in range(MICRO):
        loss = nn.functional.mse_loss(model(xs[i]), ys[i])
        (loss / ACCUM).backward()
        losses.append(loss.item())
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    return losses


def _train(rank, world, env):
    os.environ.update(env)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator

    import fsdp_plugin as fp

    acc = Accelerator(gradient_accumulation_steps=ACCUM)
    model, opt = build()
    model, opt = acc.prepare(model, opt)
    xs, ys = data()
    half = BATCH // world
    losses, comm = [], []
    for i in range(MICRO):
        before = fp.comm_stats.snapshot()["calls"]
        with acc.accumulate(model):
            mine = slice(rank * half, (rank + 1) * half)
            loss = nn.functional.mse_loss(model(xs[i][mine]), ys[i][mine])
            acc.backward(loss)
            after = fp.comm_stats.snapshot()["calls"]
            delta = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
            comm.append((acc.sync_gradients, delta))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    cfg = acc.sharding_configs[0]
    return {"losses": losses, "comm": comm, "strategy": cfg.sharding_strategy, "mesh": cfg.device_mesh,
            "local_numel": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("case", sorted(CASES))
def test_strategy_from_env_trains_like_single_process(case):
    env, strategy, mesh = CASES[case]
    r0, r1 = run_ranks(_train, 2, dict(BASE, **env), timeout=90)
    assert (r0["strategy"], r0["mesh"]) == (strategy, mesh)
    ref = reference()
    assert max(abs(a - b) for a, b in zip(r0["losses"], ref)) <= 1e-5, (r0["losses"], ref)
    assert r0["losses"] == r1["losses"]
    total = sum(p.numel() for p in build()[0].parameters())
    assert r0["local_numel"] == (total if strategy in ("no_shard", "hybrid_shard") else r0["local_numel"])
    if strategy in ("full_shard", "shard_grad_op"):
        assert r0["local_numel"] < total
    if strategy == "no_shard":  # nothing to gather: a non-sync micro-step moves no data at all
        non_sync = [calls for sync, calls in r0["comm"] if not sync]
        assert all(set(calls) <= {"control"} for calls in non_sync), non_sync  # first forward: bookkeeping only
        assert non_sync[-1] == {}, non_sync
    assert all(calls for sync, calls in r0["comm"] if sync)
