"""Leave in one command: ``fsdp-plugin export CKPT OUT --format dcp`` gives a directory that torch's own
``dcp.load`` reads into an FSDP2 model and optimizer, bit-exact, continuing with our run's losses."""
from __future__ import annotations

import os

import pytest
import torch
from _dcp_source import (
    STEPS_AFTER,
    STEPS_BEFORE,
    assemble,
    fsdp2_model,
    full_state,
    groups,
    make_model,
    our_full_state,
    step,
)
from _dist import run_ranks
from models import Block

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import CheckpointError
from fsdp_plugin.cli import main

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _our_run(rank, world, path):
    model = fp.shard(make_model(0), auto_wrap_policy={Block})
    opt = groups(model)
    for i in range(STEPS_BEFORE):
        step(model, opt, i, rank, world)
    fp.save_checkpoint(path, model, opt, extra={"step": STEPS_BEFORE, "tag": "ours"})
    state = our_full_state(model, opt)
    return [step(model, opt, STEPS_BEFORE + i, rank, world) for i in range(STEPS_AFTER)], state


def _stock_resume(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = fsdp2_model(seed=9)
    opt = groups(model, lr=1.0)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd, "extra": {"step": 0, "tag": ""}}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert sd["extra"] == {"step": STEPS_BEFORE, "tag": "ours"}, sd["extra"]
    assert opt.param_groups[0]["lr"] == 3e-3 and opt.param_groups[0]["weight_decay"] == 0.1
    state = full_state(model, opt)
    return [step(model, opt, STEPS_BEFORE + i, rank, world) for i in range(STEPS_AFTER)], state


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    ours = run_ranks(_our_run, 2, str(base / "ours"), timeout=180)
    assert main(["export", str(base / "ours"), str(base / "dcp"), "--format", "dcp"]) == 0
    shapes = {k: v.shape for k, v in ours[0][1][0].items()}
    return str(base / "dcp"), ours[0][0], assemble([s for _, s in ours], shapes)


@pytest.mark.parametrize("world", [2, 3])
def test_stock_fsdp2_loads_the_export(exported, world):
    path, want_losses, want_state = exported
    got = run_ranks(_stock_resume, world, path, timeout=180)
    losses, state = got[0]
    for k, v in want_state.items():
        assert torch.equal(state[k], v), k
    assert state["head.weight"].data_ptr() != 0 and torch.equal(state["head.weight"], want_state["tok.weight"])
    assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-6, (losses, want_losses)


def test_export_round_trips_through_our_reader_and_refuses_to_overwrite(exported, tmp_path):
    path, _, want_state = exported
    model = make_model(4)
    opt = groups(model)
    extra = fp.load_checkpoint(path, model, opt)
    assert extra == {"extra": {"step": STEPS_BEFORE, "tag": "ours"}}
    assert torch.equal(model.pos.detach(), want_state["pos"])
    assert torch.equal(opt.state[model.pos]["exp_avg"], want_state["pos:exp_avg"])
    hf = os.path.join(os.path.dirname(path), "hf")  # --format hf stays: Hugging Face safetensors
    assert main(["export", os.path.join(os.path.dirname(path), "ours"), hf, "--format", "hf", "-q"]) == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(os.path.join(hf, "model.safetensors"))["pos"], want_state["pos"])
    with pytest.raises(CheckpointError, match="already exists"):
        from fsdp_plugin.checkpoint.dcp import export_dcp
        export_dcp(os.path.join(os.path.dirname(path), "ours"), path)
