"""Tensor parallelism inside units (issue 31): a DTensor model parallelized on mesh['tp'] and sharded over the
data-parallel dims trains like one process on the global batch, per step within 1e-5 (loss, full gradients,
full parameters), at world 4 = 2 dp x 2 tp on gloo."""
import pytest

from _dist import run_ranks
import _tp

STEPS = 3
_REF: dict = {}


def ref(dp, optim, clip=None):
    if (dp, optim, clip) not in _REF:
        _REF[dp, optim, clip] = _tp.reference(dp, optim, STEPS, clip)
    return _REF[dp, optim, clip]


@pytest.mark.parametrize("strategy,dp_shape,optim", [
    ("full_shard", (2,), "adamw"), ("full_shard", (2,), "sgd"), ("shard_grad_op", (2,), "sgd"),
    ("hybrid_shard", (1, 2), "adamw"), ("no_shard", (2,), "sgd"),
])
def test_2d_matches_one_process(strategy, dp_shape, optim):
    results = run_ranks(_tp.worker, 4, dp_shape, 2, optim, STEPS, strategy, timeout=240)
    for got in results:
        _tp.assert_matches(got, ref(2, optim))


def test_clip_grad_norm_exact_over_dp_and_tp():
    """Clipping at a norm below the gradients' counts TP-sharded boxes over TP and replicated ones once."""
    results = run_ranks(_tp.worker, 4, (2,), 2, "sgd", STEPS, "full_shard", 0.05, timeout=240)
    want = ref(2, "sgd", 0.05)
    assert all(w[3] > 0.05 for w in want), "the clip must bite for the test to mean anything"
    for got in results:
        _tp.assert_matches(got, want)


def test_comparison_can_fail():
    """A reference at another dp size (other global batch) is caught."""
    got = run_ranks(_tp.worker, 4, (2,), 2, "sgd", 1, "full_shard", timeout=240)[0]
    with pytest.raises(AssertionError):
        _tp.assert_matches(got, _tp.reference(1, "sgd", 1))
