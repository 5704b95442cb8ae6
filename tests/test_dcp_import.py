"""Resume a torch FSDP2 + DCP run on our engine: bit-exact state, the stock run's losses (≤ 1e-6), any world."""
from __future__ import annotations

import pytest
import torch
from _dcp_source import (
    STEPS_AFTER,
    STEPS_BEFORE,
    assemble,
    groups,
    make_model,
    our_full_state,
    save_run,
    step,
)
from _dist import run_ranks
from models import Block

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _ours(seed, world):
    model = fp.shard(make_model(seed), auto_wrap_policy={Block})
    return model, groups(model, lr=1.0)  # wrong lr on purpose: the checkpoint's must win


def _load_run(rank, world, path):
    model, opt = _ours(123, world)
    extra = fp.load_checkpoint(path, model, opt)
    assert extra == {"extra": {"step": STEPS_BEFORE, "name": "run"}}, extra
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert opt.param_groups[1]["weight_decay"] == 0.0
    state = our_full_state(model, opt)
    losses = [step(model, opt, STEPS_BEFORE + i, rank, world) for i in range(STEPS_AFTER)]
    return losses, state


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "step2")
    saved = run_ranks(save_run, 2, path, timeout=180)
    return path, saved[0][0], saved[0][1]


@pytest.mark.parametrize("world", [2, 3])
def test_resume_fsdp2_dcp(source, world):
    path, want_losses, want_state = source
    got = run_ranks(_load_run, world, path, timeout=180)
    state = assemble([s for _, s in got], {k: v.shape for k, v in want_state.items()})
    for k, v in want_state.items():
        if k == "head.weight":
            continue  # tied to tok.weight: one parameter here
        assert k in state, k
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
    losses = got[0][0]
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-6, (losses, want_losses)
