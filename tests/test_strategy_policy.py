"""Strategy as data: ShardingConfig.reshard_after_forward decides per unit, in one place."""
import pytest
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, make_optimizer, single_process, train
from models import GPT, Block



def _flags(**kwargs):
    model = fp.shard(GPT(), auto_wrap_policy={Block}, **kwargs)
    return {u.fqn: u.reshard_after_forward for u in model._fp_root.units}


@pytest.mark.parametrize("kwargs,want", [
    ({}, {"": False, "blocks.0": True, "blocks.1": True, "blocks.2": True}),
    ({"sharding_strategy": "shard_grad_op"}, {"": False, "blocks.0": False, "blocks.1": False, "blocks.2": False}),
    ({"sharding_strategy": "shard_grad_op", "reshard_after_forward": {Block}},
     {"": False, "blocks.0": True, "blocks.1": True, "blocks.2": True}),
    ({"reshard_after_forward": False}, {"": False, "blocks.0": False, "blocks.1": False, "blocks.2": False}),
    ({"reshard_after_forward": {nn.Linear}}, {"": False, "blocks.0": False, "blocks.1": False, "blocks.2": False}),
    ({"reshard_after_forward": lambda fqn, m: fqn != "blocks.2"},
     {"": False, "blocks.0": True, "blocks.1": True, "blocks.2": False}),
])
def test_reshard_after_forward_per_unit(kwargs, want):
    assert _flags(**kwargs) == want


def _worker(rank, world, steps):
    out = {}
    for name, rule in (("reshard_all", True), ("default", None), ("keep_last", lambda fqn, m: fqn != "blocks.2")):
        import torch
        torch.manual_seed(0)
        model = fp.shard(GPT(), auto_wrap_policy={Block}, reshard_after_forward=rule)
        opt = make_optimizer("sgd", model.parameters())
        fp.comm_stats.reset()
        losses = train(model, opt, rank, world, steps)
        out[name] = (losses, fp.comm_stats.calls["all_gather"])
    return out


def test_keeping_the_last_block_saves_its_backward_all_gather_and_matches_single_process():
    steps = 4
    want, _ = single_process(2, "sgd", steps=steps)
    results = run_ranks(_worker, 2, steps, timeout=120)
    for out in results:
        for name in ("reshard_all", "default", "keep_last"):
            assert_close_losses(out[name][0], want)
        assert out["reshard_all"][1] - out["keep_last"][1] == steps, out   # one all-gather fewer per step
        # the default keeps the last unit once the first forward has recorded the order
        assert out["reshard_all"][1] - out["default"][1] == steps - 1, out
