"""Issue 48's stream protocol on CPU, with a fake stream module standing in for ``torch.cuda``: every all-gather
is issued on the gather stream after that stream waited on the compute stream, every reduction on the reduce
stream likewise, nothing synchronizes the host, and the numbers are those of the stream-less run."""
import contextlib

from _dist import run_ranks
from _parity import assert_close_losses

NATIVE = {"FSDP_PLUGIN_NATIVE_COLLECTIVES": "1"}     # the branch NCCL takes: torch's native collectives


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))

    def __repr__(self):
        return self.name


class FakeCuda:
    """What ``streams.CommStreams`` uses of ``torch.cuda``."""

    def __init__(self, log):
        self.log, self.made = log, 0
        self.compute = FakeStream("compute", log)
        self.current = self.compute

    def Stream(self, device=None, priority=0):
        self.made += 1
        return FakeStream(("gather", "reduce")[self.made - 1] if self.made <= 2 else f"s{self.made}", self.log)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev


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
