"""``Accelerator.load_state(<stock accelerate FSDP SHARDED_STATE_DICT dir>)`` with our Accelerator: the
stock run's losses (≤ 1e-6) at the same and at another process count, scheduler and step restored."""
from __future__ import annotations

import os

import pytest
import torch
from _dcp_source import STEPS_AFTER, STEPS_BEFORE, groups, make_model, save_run, step
from _dist import run_ranks

pytest.importorskip("accelerate")
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
       "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
       "FSDP_SYNC_MODULE_STATES": "false", "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "localhost",
       "MASTER_PORT": "0"}


def _resume(rank, world, path):
    os.environ.update(ENV)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator()
    model = make_model(123)
    opt = groups(model, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.load_state(path)
    assert acc.step == STEPS_BEFORE
    lr = opt.param_groups[0]["lr"]
    # the stock run stepped its plain StepLR once per step; accelerate's wrapper steps num_processes times
    return [step(model, opt, STEPS_BEFORE + i, rank, world, sched.scheduler) for i in range(STEPS_AFTER)], lr


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("acc") / "checkpoint_0")
    saved = run_ranks(save_run, 2, path, "accelerate", timeout=180)
    assert sorted(os.listdir(path)) == ["optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl",
                                        "random_states_1.pkl", "scheduler.bin"]
    return path, saved[0][0]


@pytest.mark.parametrize("world", [2, 3])
def test_load_state_of_stock_sharded_dir(source, world):
    path, want = source
    got = run_ranks(_resume, world, path, timeout=180)
    losses, lr = got[0]
    assert lr == pytest.approx(3e-3 * 0.9 ** STEPS_BEFORE, rel=1e-12)
    assert max(abs(a - b) for a, b in zip(losses, want)) <= 1e-6, (losses, want)
