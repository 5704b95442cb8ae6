"""Issue 48's stream protocol on CPU, with a fake stream module standing in for ``torch.cuda``: every all-gather
is issued on the gather stream after that stream waited on the compute stream, every reduction on the reduce
stream likewise, nothing synchronizes the host, and the numbers are those of the stream-less run.

Issue 53 (finding 2): `PoolModel` (``tests/_pools.py``, shared with cpu_offload's copy streams in
``tests/test_offload_streams.py``), a model of the CUDA caching allocator's per-stream pools, checks block
lifetimes across those streams — the hazard FSDP2's copy-in on the current stream exists for."""
from _dist import run_ranks
from _pools import FakeCuda, PoolModel, pool_worker
from _parity import assert_close_losses

NATIVE = {"FSDP_TEST_BACKEND": "nccl_sim"}     # the branch NCCL takes (native collectives, NCCL completion)
GLOO_NATIVE: dict = {}      # the pool model sees collectives as dispatcher ops (c10d::...): gloo issues them so


def _worker(rank, world, fake, strategy, mesh=None):
    import torch

    import fsdp_plugin as fp
    from fsdp_plugin import _compat
    from fsdp_plugin._flat import streams
    from _parity import make_optimizer, train
    from models import GPT, Block

    log = []
    cuda = FakeCuda(log)
    torch.manual_seed(0)
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, **({"device_mesh": mesh} if mesh else {}))
    if fake:
        side = streams.CommStreams(torch.device("cpu"), backend=cuda)
        handles = [h for u in model._fp_root.units for h in u.handles]
        for h in handles:
            h.streams = side
        real_ag, real_rs = _compat.all_gather_into, _compat.reduce_scatter_into

        def ag(*a, **k):
            log.append(("all_gather", cuda.current.name))
            return real_ag(*a, **k)

        def rs(*a, **k):
            log.append(("reduce_scatter", cuda.current.name))
            return real_rs(*a, **k)
        _compat.all_gather_into, _compat.reduce_scatter_into = ag, rs
        import torch.distributed as dist
        real_ar = dist.all_reduce

        def ar(t, *a, **k):      # the engine's gradients (float; the masks' uint8 one is the control group's)
            import sys
            if t.is_floating_point() and sys._getframe(1).f_globals["__name__"].startswith("fsdp_plugin"):
                log.append(("all_reduce", cuda.current.name))
            return real_ar(t, *a, **k)
        dist.all_reduce = ar
        sync = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: log.append(("cuda.synchronize",))
    try:
        losses = train(model, make_optimizer("sgd", model.parameters()), rank, world, 3)
    finally:
        if fake:
            torch.cuda.synchronize = sync
    return losses, log


STREAM_OF = {"all_gather": "gather", "reduce_scatter": "reduce", "all_reduce": "reduce"}


def _check_protocol(log, hybrid=False):
    issues = [e for e in log if e[0] in STREAM_OF]
    want = {("all_gather", "gather"), ("reduce_scatter", "reduce")} | ({("all_reduce", "reduce")} if hybrid else set())
    assert set(issues) == want, set(issues)
    # every issue is preceded (since the previous one) by its stream's wait on the compute stream
    waited = set()
    for e in log:
        if e[0] == "wait_stream":
            assert e[2] == "compute", e
            waited.add(e[1])
        elif e[0] in STREAM_OF:
            stream = STREAM_OF[e[0]]
            assert stream in waited, e
            waited.discard(stream)
    assert not any(e[0] in ("synchronize", "cuda.synchronize") for e in log), log


def test_hybrids_replica_all_reduce_issues_on_the_reduction_stream():
    plain = run_ranks(_worker, 4, False, "hybrid_shard", (2, 2), env=NATIVE, timeout=120)
    faked = run_ranks(_worker, 4, True, "hybrid_shard", (2, 2), env=NATIVE, timeout=120)
    assert_close_losses(faked[0][0], plain[0][0], tol=0.0)
    for _, log in faked:
        _check_protocol(log, hybrid=True)


_RUNS: dict = {}


def _runs():
    if not _RUNS:
        _RUNS["plain"] = run_ranks(_worker, 2, False, "full_shard", env=NATIVE, timeout=120)
        _RUNS["faked"] = run_ranks(_worker, 2, True, "full_shard", env=NATIVE, timeout=120)
    return _RUNS["plain"], _RUNS["faked"]


def test_collectives_issue_on_side_streams_after_waiting_on_compute():
    plain, faked = _runs()
    assert_close_losses(faked[0][0], plain[0][0], tol=0.0)      # same kernels, same order: the same bits
    for _, log in faked:
        assert sum(e[0] == "reduce_scatter" for e in log) >= 3 * 3      # every unit, every step
        _check_protocol(log)


def test_the_protocol_check_can_fail():
    """The check is not vacuous: the same log without the side streams' waits, or with an issue on the compute
    stream, fails it."""
    import pytest
    log = _runs()[1][0][1]
    with pytest.raises(AssertionError):
        _check_protocol([e for e in log if e[0] != "wait_stream"])
    with pytest.raises(AssertionError):
        _check_protocol([("all_gather", "compute") if e[0] == "all_gather" else e for e in log])


# ------------------------------------------------------------------ the caching allocator's per-stream pools
def test_no_block_read_on_a_side_stream_is_reused_before_its_pool_passed_the_read():
    """bf16 compute, fp32 reduction (the default GPU recipe): full_shard and no_shard at world 2, hybrid (2 x 2,
    its replica all-reduce on the reduce stream) at world 4: no gradient, cast or collective buffer goes back to
    a pool whose stream may reuse it before another stream's access of it is ordered before. On the code before
    issue 53 the bf16 gradient was cast on the reduce stream and freed to the compute pool with no wait: the
    next unit's backward could overwrite it before the cast."""
    for strategy, world, mesh in (("full_shard", 2, None), ("no_shard", 2, None), ("hybrid_shard", 4, (2, 2))):
        for losses, violations, seen in run_ranks(pool_worker, world, strategy, True, 2, mesh,
                                                  env=GLOO_NATIVE, timeout=120):
            assert violations == [], (strategy, violations[:3])
            assert seen["checked"] > 50 and seen["cross"] > 0, (strategy, seen)    # it saw the blocks it models


def test_the_pool_model_can_fail():
    """The model flags the hazard of finding 2 itself: a block allocated on compute, read on a side stream,
    freed, then reused by compute before compute waited on that stream — and not once compute waited."""
    import torch
    m = PoolModel()
    ops = torch.ops.aten
    for ordered in (False, True):
        m.violations.clear()
        grad = m.run("compute", ops.ones.default, ([8],), {"dtype": torch.bfloat16})
        m.wait("reduce", "compute")       # ``streams.on(reduce)``: the cast reads a finished gradient
        m.run("reduce", ops._to_copy.default, (grad,), {"dtype": torch.float32})
        del grad
        if ordered:
            m.wait("compute", "reduce")
        m.run("compute", ops.zeros.default, ([8],), {})
        assert bool(m.violations) is not ordered, m.violations


def _source_worker(rank, world):
    import torch

    import fsdp_plugin as fp
    from fsdp_plugin._comm import collectives
    from _parity import make_optimizer, train
    from models import GPT, Block

    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    handles = [h for u in model._fp_root.units for h in u.handles]
    held, plain = [], collectives.wait

    def wait(work, what="collective", *a, **k):
        if what.startswith("all-gather of unit"):
            held.append(any(h._gather is not None and h._gather[0] is work and h._gather[1] is not None
                            for h in handles))
        return plain(work, what, *a, **k)
    collectives.wait = wait
    try:
        train(model, make_optimizer("sgd", model.parameters()), rank, world, 2)
    finally:
        collectives.wait = plain
    return held


def test_an_all_gathers_source_is_held_until_its_wait_returns():
    """Finding 12: the all-gather's source (read on NCCL's stream) is still referenced by the handle while
    ``wait_unshard`` waits, so a wait that raises cannot free it with no stream ordering."""
    for held in run_ranks(_source_worker, 2, env=NATIVE, timeout=120):
        assert len(held) >= 2 * 3 and all(held), held


def test_the_engine_never_calls_record_stream():
    """Cross-stream lifetimes are objects that hold a buffer until a stream wait (``_PendingReduce``, the gather's
    source, the offload copier's ``_reading``, the async save's stager), never ``record_stream``: its block outlives
    an unknown amount of later work and the allocator model here could not check it."""
    import ast
    import pathlib

    import fsdp_plugin
    root = pathlib.Path(fsdp_plugin.__file__).parent
    calls = [f"{path.relative_to(root)}:{node.lineno}" for path in root.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "record_stream"]
    assert calls == [], calls
