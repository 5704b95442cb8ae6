"""A checkpoint written by format version 1 (tests/fixtures/ckpt_v1, saved at world 2 before issue 31
changed the format) still loads, model and optimizer state, exactly, at world 1 and 2."""
import os
import sys

import torch

import fsdp_plugin as fp
from _dist import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from make_ckpt_v1 import fixture_model, fixture_values  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "ckpt_v1")


def _load(rank, world):
    model = fp.shard(fixture_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = fp.load_checkpoint(FIXTURE, model, opt)
    assert extra == {"step": 7}
    for p in model.parameters():
        info = fp.param_info(p)
        want = fixture_values(info.fqn, info.shape, 100.0).reshape(-1)[info.start:info.end]
        assert torch.equal(opt.state[p]["momentum_buffer"].reshape(-1), want), info.fqn
    state = fp.full_state_dict(model)
    if rank == 0:
        for name, v in state.items():
            assert torch.equal(v, fixture_values(name, v.shape, 0.0)), name
    return True


def test_v1_fixture_loads_at_world_1_and_2():
    assert run_ranks(_load, 1) == [True]
    assert run_ranks(_load, 2) == [True, True]


def test_v1_fixture_consolidates(tmp_path):
    from safetensors.torch import load_file
    from fsdp_plugin.checkpoint.consolidate import consolidate
    consolidate(FIXTURE, str(tmp_path / "out"))
    files = [f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors")]
    got = {}
    for f in files:
        got.update(load_file(str(tmp_path / "out" / f)))
    for name, v in got.items():
        assert torch.equal(v, fixture_values(name, v.shape, 0.0)), name
