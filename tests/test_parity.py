"""fp32 training under every strategy and world size equals single-process training within 1e-5."""
import pytest

from _dist import run_ranks
from _parity import (assert_close_losses, assert_close_state, ddp_worker, sharded_worker,
                     single_process)

CASES = [
    (1, "full_shard", None), (1, "no_shard", None),
    (2, "full_shard", None), (2, "shard_grad_op", None), (2, "no_shard", None), (2, "hybrid_shard", (1, 2)),
    (3, "full_shard", None), (3, "shard_grad_op", None), (3, "no_shard", None),
    (4, "full_shard", None), (4, "shard_grad_op", None), (4, "no_shard", None), (4, "hybrid_shard", (2, 2)),
]
_REF: dict = {}


def reference(world, optim):
    if (world, optim) not in _REF:
        _REF[world, optim] = single_process(world, optim)
    return _REF[world, optim]


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("world,strategy,mesh", CASES)
def test_matches_single_process(world, strategy, mesh, optim):
    want_losses, want_state = reference(world, optim)
    results = run_ranks(sharded_worker, world, strategy, optim, mesh, timeout=120)
    for losses, _ in results:
        assert_close_losses(losses, want_losses)
    assert_close_state(results[0][1], want_state)
    assert all(state == {} for _, state in results[1:]), "full_state_dict must be empty off rank 0"


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
def test_matches_ddp(world, optim):
    ddp = run_ranks(ddp_worker, world, optim, timeout=120)[0]
    ours = run_ranks(sharded_worker, world, "full_shard", optim, None, timeout=120)[0][0]
    assert_close_losses(ours, ddp)
    assert_close_losses(ddp, reference(world, optim)[0])


def test_parity_check_can_fail():
    """The comparison is not vacuous: a different learning rate is caught."""
    losses, _ = reference(2, "sgd")
    with pytest.raises(AssertionError):
        assert_close_losses([x + 2e-5 for x in losses], losses)
