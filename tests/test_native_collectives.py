"""The branch NCCL users take, executed on CPU: under ``nccl_sim`` (``fsdp_plugin.testing``: NCCL's completion
semantics) the engine sends every unit collective through torch's native collectives into flat tensors and
checks pairing by the ledger hash; on gloo it keeps the point-to-point emulation and identity tags.

These tests prove the backend changes the branch (counted calls, not times); ``.ci/run``'s nccl_sim lane runs the
parity suite (every strategy at world 2-4, hybrid, activation checkpointing, mixed precision, checkpoints,
quantized collectives, deadlines) with ``FSDP_TEST_BACKEND=nccl_sim``.
"""
import pytest

from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, single_process

import fsdp_plugin as fp

NATIVE = {"FSDP_TEST_BACKEND": "nccl_sim"}


def _counting_worker(rank, world, strategy, mesh):
    """Train as the parity suite does, counting which branch each unit collective took."""
    from collections import Counter

    import torch

    from fsdp_plugin import _compat
    from fsdp_plugin._comm import p2p
    from _parity import make_optimizer, train
    from models import GPT, Block

    calls = Counter()
    native_ag, native_rs = _compat.all_gather_into, _compat.reduce_scatter_into

    def ag(*a, **k):
        calls["native all-gather"] += 1
        return native_ag(*a, **k)

    def rs(*a, **k):
        calls["native reduce-scatter"] += 1
        return native_rs(*a, **k)

    _compat.all_gather_into, _compat.reduce_scatter_into = ag, rs
    for cls in (p2p._P2PAllGather, p2p._P2PReduceScatter, p2p._P2PAllReduce, p2p._P2PPairSum):
        init = cls.__init__

        def counted(self, *a, _init=init, _name=cls.__name__, **k):
            calls[_name] += 1
            _init(self, *a, **k)
        cls.__init__ = counted
    torch.manual_seed(0)
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, **({"device_mesh": mesh} if mesh else {}))
    opt = make_optimizer("sgd", model.parameters())
    losses = train(model, opt, rank, world, 4)
    return losses, dict(calls), model._fp_root.pairing, fp.full_state_dict(model)


@pytest.mark.parametrize("strategy,mesh", [("full_shard", None), ("hybrid_shard", (2, 2))])
def test_nccl_sim_takes_the_native_branch(strategy, mesh):
    """nccl_sim: every unit collective is torch's native one and pairing is the NCCL mode ("hash"); gloo: the
    point-to-point emulation and identity tags. Same numbers both ways."""
    world = 4
    native = run_ranks(_counting_worker, world, strategy, mesh, env=NATIVE, timeout=120)
    p2p = run_ranks(_counting_worker, world, strategy, mesh, timeout=120)
    for losses, calls, mode, _ in native:
        assert mode == "hash"
        assert calls.get("native all-gather", 0) > 0 and calls.get("native reduce-scatter", 0) > 0, calls
        assert not any(k.startswith("_P2P") for k in calls), calls
    for losses, calls, mode, _ in p2p:
        assert mode == "tags"
        assert calls.get("_P2PAllGather", 0) > 0 and "native all-gather" not in calls, calls
    assert_close_losses(native[0][0], p2p[0][0])
    want_losses, want_state = single_process(world, "sgd", steps=4)
    assert_close_losses(native[0][0], want_losses)
    assert_close_state(native[0][3], want_state)
