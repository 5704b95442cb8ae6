"""Issue 48's stream protocol on CPU, with a fake stream module standing in for ``torch.cuda``: every all-gather
is issued on the gather stream after that stream waited on the compute stream, every reduction on the reduce
stream likewise, nothing synchronizes the host, and the numbers are those of the stream-less run.

Issue 53 (finding 2): `PoolModel`, a model of the CUDA caching allocator's per-stream pools, checks block
lifetimes across those streams — the hazard FSDP2's copy-in on the current stream exists for."""
import contextlib
import weakref

from _dist import run_ranks
from _parity import assert_close_losses

NATIVE = {"FSDP_TEST_BACKEND": "nccl_sim"}     # the branch NCCL takes (native collectives, NCCL completion)
GLOO_NATIVE: dict = {}      # the pool model sees collectives as dispatcher ops (c10d::...): gloo issues them so


class FakeStream:
    def __init__(self, name, log, model=None):
        self.name, self.log, self.model = name, log, model

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))
        if self.model is not None:
            self.model.wait(self.name, other.name)

    def synchronize(self):
        self.log.append(("synchronize", self.name))

    def __repr__(self):
        return self.name


class FakeCuda:
    """What ``streams.CommStreams`` uses of ``torch.cuda``."""

    def __init__(self, log, model=None):
        self.log, self.made, self.model = log, 0, model
        self.compute = FakeStream("compute", log, model)
        self.current = self.compute

    def Stream(self, device=None, priority=0):
        self.made += 1
        name = ("gather", "reduce")[self.made - 1] if self.made <= 2 else f"s{self.made}"
        return FakeStream(name, self.log, self.model)

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


# ------------------------------------------------------------------ the caching allocator's per-stream pools
class PoolModel:
    """The CUDA caching allocator's stream contract, on CPU (issue 53, finding 2).

    Every aten op runs on the fake current stream; every collective (a ``c10d`` op) runs on one NCCL stream that
    waits on the issuing stream at issue, and ``Work.wait()`` makes the current stream wait on the NCCL stream
    up to that collective — what ProcessGroupNCCL does. Streams carry vector clocks: ``knows[s][t]`` is how far
    stream ``s`` is ordered after stream ``t`` (by ``wait_stream`` and work waits, transitively).

    A block (a storage allocated while the model runs) belongs to the pool of the stream current at its
    allocation, and records every (stream, position) that read or wrote it. When the host frees it, the
    allocator may hand it to the next allocation on its pool's stream, which that stream's next op may
    write: so at the pool stream's next op, every access by another stream must already be ordered before it.
    Otherwise the access may still be pending when the block is overwritten — a violation. Blocks that
    existed before the model started (shards, the unsharded buffers resized in place) are not tracked."""

    NCCL = "nccl"

    def __init__(self):
        self.clock: dict = {}
        self.knows: dict = {}
        self.blocks: dict = {}            # id(storage) -> [pool stream, [(stream, position, op)]]
        self.freed: dict = {}             # pool stream -> blocks freed since its last op
        self.works: dict = {}             # id(Work) -> (the work, what the NCCL stream knew after issuing it)
        self.violations: list = []
        self.checked = 0                  # freed blocks checked (the model saw the traffic it models)
        self.cross = 0                    # ...of which another stream had accessed

    def _tick(self, stream) -> int:
        self.clock[stream] = self.clock.get(stream, 0) + 1
        self.knows.setdefault(stream, {})[stream] = self.clock[stream]
        return self.clock[stream]

    def _merge(self, into, seen: dict) -> None:
        mine = self.knows.setdefault(into, {})
        for t, pos in seen.items():
            mine[t] = max(mine.get(t, 0), pos)

    def wait(self, waiter, other) -> None:
        """``waiter.wait_stream(other)``: ordered after everything queued on ``other`` so far."""
        self._merge(waiter, dict(self.knows.get(other, {})))

    def work_wait(self, work, current) -> None:
        entry = self.works.pop(id(work), None)      # not kept past its wait: a Work holds its tensors
        if entry is not None and entry[0] is work:
            self._merge(current, entry[1])

    def _check_pool(self, stream) -> None:
        known = self.knows.get(stream, {})
        for pool_block in self.freed.pop(stream, []):
            self.checked += 1
            late = [(s, pos, op) for s, pos, op in pool_block if s != stream]
            self.cross += bool(late)
            for s, pos, op in late:
                if known.get(s, 0) < pos:
                    self.violations.append(f"a block of the {stream!r} pool, {op} on {s!r} (#{pos}), reused by "
                                           f"{stream!r} ordered only up to {s!r} #{known.get(s, 0)}")

    def _storages(self, tree):
        import torch
        from torch.utils._pytree import tree_leaves
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                yield t.untyped_storage()

    def _freed(self, key, pool) -> None:
        block = self.blocks.pop(key, None)
        if block is not None:
            self.freed.setdefault(pool, []).append(block[1])

    def run(self, stream, func, args, kwargs):
        import torch
        import torch.distributed as dist
        collective = func.namespace == "c10d"
        self._check_pool(stream)          # this op may be the one that reuses a block freed to the pool
        if collective:
            self.wait(self.NCCL, stream)
        where = self.NCCL if collective else stream
        pos = self._tick(where)
        inputs = {id(st) for st in self._storages((args, kwargs))}
        for st in self._storages((args, kwargs)):
            if id(st) in self.blocks:
                self.blocks[id(st)][1].append((where, pos, func.__name__))
        out = func(*args, **kwargs)
        for st in self._storages(out):
            if id(st) not in inputs and id(st) not in self.blocks and st.nbytes() > 0:
                self.blocks[id(st)] = [stream, [(where, pos, func.__name__)]]
                weakref.finalize(st, self._freed, id(st), stream)
        if collective:
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(o, torch.ScriptObject):
                    work = dist.Work.unbox(o)
                    self.works[id(work)] = (work, dict(self.knows[self.NCCL]))
        return out


def _pool_worker(rank, world, strategy, mixed, steps=2, mesh=None):
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import fsdp_plugin as fp
    from fsdp_plugin._flat import streams
    from _parity import make_optimizer, train
    from models import GPT, Block

    model_ = PoolModel()
    cuda = FakeCuda([], model_)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return model_.run(cuda.current.name, func, args, kwargs or {})

    torch.manual_seed(0)
    mp = {"mixed_precision": fp.MixedPrecision(param_dtype=torch.bfloat16)} if mixed else {}
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, **mp,
             **({"device_mesh": mesh} if mesh else {}))
    side = streams.CommStreams(torch.device("cpu"), backend=cuda)
    for u in model._fp_root.units:
        for h in u.handles:
            h.streams = side
    from fsdp_plugin.testing import SimWork
    work_class = SimWork if dist.get_backend() == "nccl_sim" else dist.Work
    plain_wait = work_class.wait

    def wait(work, *a, **k):
        out = plain_wait(work, *a, **k)
        model_.work_wait(work, cuda.current.name)
        return out
    opt = make_optimizer("sgd", model.parameters())
    work_class.wait = wait
    try:
        with Mode():
            losses = train(model, opt, rank, world, steps)
    finally:
        work_class.wait = plain_wait
    return losses, model_.violations, model_.checked, model_.cross


def test_no_block_read_on_a_side_stream_is_reused_before_its_pool_passed_the_read():
    """bf16 compute, fp32 reduction (the default GPU recipe): full_shard and no_shard at world 2, hybrid (2 x 2,
    its replica all-reduce on the reduce stream) at world 4: no gradient, cast or collective buffer goes back to
    a pool whose stream may reuse it before another stream's access of it is ordered before. On the code before
    issue 53 the bf16 gradient was cast on the reduce stream and freed to the compute pool with no wait: the
    next unit's backward could overwrite it before the cast."""
    for strategy, world, mesh in (("full_shard", 2, None), ("no_shard", 2, None), ("hybrid_shard", 4, (2, 2))):
        for losses, violations, checked, cross in run_ranks(_pool_worker, world, strategy, True, 2, mesh,
                                                            env=GLOO_NATIVE, timeout=120):
            assert violations == [], (strategy, violations[:3])
            assert checked > 50 and cross > 0, (strategy, checked, cross)    # it saw the blocks it models


def test_the_pool_model_can_fail():
    """The model flags the hazard of finding 2 itself: a block allocated on compute, read on a side stream,
    freed, then reused by compute before compute waited on that stream — and not once compute waited."""
    import torch
    m = PoolModel()
    ops = torch.ops.aten
    for ordered in (False, True):
        m.violations.clear()
        grad = m.run("compute", ops.ones.default, ([8],), {"dtype": torch.bfloat16})
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
