"""Strategy as data: ShardingConfig.reshard_after_forward decides per unit, in one place."""
import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, make_optimizer, single_process, train
from models import GPT, Block



def _flags(**kwargs):
    model = fp.shard(GPT(), auto_wrap_policy={Block}, **kwargs)
    root = model._fp_root
    return {u.fqn: root.reshards_after_forward(u) for u in root.units}


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


def _two_forwards(rank, world, steps, sharded):
    """Each step: a grad-enabled forward whose output is dropped (no backward), then two forwards on two
    batches and one backward of their mean. Under the default policy the last block stays unsharded across all
    three forwards (the order is frozen after the first step); the result must not depend on that."""
    import torch
    from models import gpt_batch
    torch.manual_seed(0)
    model = GPT()
    if sharded:
        model = fp.shard(model, auto_wrap_policy={Block})
    opt = make_optimizer("sgd", model.parameters())
    for s in range(steps):
        batches = [gpt_batch(2 * s + i, r) for i in range(2) for r in (range(world) if not sharded else [rank])]
        if not sharded:   # one process on the global batch of each micro-step
            batches = [tuple(torch.cat(t) for t in zip(*batches[i * world:(i + 1) * world])) for i in range(2)]
        model(*batches[0]).detach()
        if sharded:   # the scenario under test: kept once the order is frozen
            assert model._fp_root.exec_order[-1].handles[0].is_unsharded == (s > 0)
        loss = (model(*batches[0]) + model(*batches[1])) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return fp.full_state_dict(model) if sharded else model.state_dict()


def test_kept_last_unit_survives_extra_forwards_before_backward():
    want = _two_forwards(0, 2, 3, sharded=False)
    assert_close_state(run_ranks(_two_forwards, 2, 3, True, timeout=120)[0], want)


def test_memory_report_shows_the_one_reshard_table():
    """``RootState.reshard_table`` (strategy.reshard_after_forward_table) is what forward obeys and what the
    report shows: root no, blocks yes, the last block kept once the first forward recorded the order."""
    from models import GPT, Block, gpt_batch

    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    col = lambda: [line.split()[4] for line in fp.memory_report(model).splitlines()[2:-1]]  # noqa: E731
    assert col() == ["no", "yes", "yes", "yes"]
    model(*gpt_batch(0, 0)).backward()
    assert col() == ["no", "yes", "yes", "kept"]
    root = model._fp_root
    assert [root.reshards_after_forward(u) for u in root.units] == [False, True, True, False]
