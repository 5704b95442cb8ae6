"""A CPU model of the CUDA caching allocator's per-stream pools (issue 53), and the fake streams that run the engine
under it: ``tests/test_streams.py`` (the comm side streams, ``streams.py``) and ``tests/test_offload_streams.py``
(cpu_offload's copy streams, ``_flat/offload.py``).

What is modeled. Streams carry vector clocks (``knows[s][t]``: how far stream ``s`` is ordered after stream ``t``),
advanced by every op issued on a stream and merged by ``wait_stream`` / ``wait_event`` (an event is the clock of
its stream when recorded). The host has a clock too: ``Event.synchronize`` / ``Stream.synchronize`` tell it what
finished, and anything it issues afterwards, on any stream, is ordered after that. Every aten op runs on the fake
current stream; every collective (a ``c10d`` op) on one NCCL stream that waits on the issuing stream at issue, and
``Work.wait()`` orders the current stream after the NCCL stream up to that collective (ProcessGroupNCCL).

A block (a storage an op allocated while the model runs) belongs to the pool of the stream current at its
allocation. Two rules of the allocator, with no ``record_stream``:

1. reuse: when the host frees a block, its pool's stream may hand it to its next allocation and overwrite it, so at
   that stream's next op every other stream's access of the block must already be ordered before (or known done
   by the host);
2. first use elsewhere: the block may be the memory of an older block the pool's stream was still using when it
   was handed out, so another stream may touch it only once ordered after the allocation (cpu_offload's ``h2d``
   writes a destination allocated on its user's stream: it waits for that stream first).

Not modeled: host (pinned) memory, which no pool owns; blocks made before the model started (shards, the unsharded
buffers resized in place); data races on values (the parity tests cover values).
"""
from __future__ import annotations

import collections
import contextlib
import weakref


class FakeEvent:
    """A CUDA event: the clock of ``stream`` when recorded; ``synchronize`` tells the host."""

    def __init__(self, stream, host_learns: bool = True):
        self.stream, self.host_learns = stream, host_learns
        model = stream.model
        self.seen = model.record(stream.name) if model is not None else {}
        self.synced = 0

    def synchronize(self):
        self.synced += 1
        self.stream.log.append(("event.synchronize", self.stream.name))
        if self.stream.model is not None and self.host_learns:
            self.stream.model.host_sync(self.seen)


class FakeStream:
    def __init__(self, name, log, model=None):
        self.name, self.log, self.model = name, log, model
        self.waited = 0

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))
        if self.model is not None:
            self.model.wait(self.name, other.name)

    def wait_event(self, event):
        self.waited += 1
        self.log.append(("wait_event", self.name, event.stream.name))
        if self.model is not None:
            self.model.wait_event(self.name, event.seen)

    def synchronize(self):
        self.log.append(("synchronize", self.name))
        if self.model is not None:
            self.model.host_sync(self.model.record(self.name))

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


class PoolModel:
    """The CUDA caching allocator's stream contract, on CPU (issue 53, finding 2): the module docstring's rules."""

    NCCL = "nccl"

    def __init__(self):
        self.clock: dict = {}
        self.knows: dict = {}
        self.host: dict = {}              # what the host saw finish (synchronize), per stream
        self.blocks: dict = {}            # id(storage) -> [pool stream, its position at allocation, accesses]
        self.freed: dict = {}             # pool stream -> blocks freed since its last op
        self.works: dict = {}             # id(Work) -> (the work, what the NCCL stream knew after issuing it)
        self.violations: list = []
        self.checked = 0                  # freed blocks checked (the model saw the traffic it models)
        self.cross = 0                    # ...of which another stream had accessed
        self.cross_by = collections.Counter()      # ...by that other stream (once per block)
        self.first_uses = collections.Counter()    # rule 2 checks, by the accessing stream

    def _tick(self, stream) -> int:
        self.clock[stream] = self.clock.get(stream, 0) + 1
        self.knows.setdefault(stream, {})[stream] = self.clock[stream]
        return self.clock[stream]

    def _merge(self, into, seen: dict) -> None:
        mine = self.knows.setdefault(into, {})
        for t, pos in seen.items():
            mine[t] = max(mine.get(t, 0), pos)

    def _known(self, stream, other) -> int:
        """How far ``stream``'s next op is ordered after ``other``: by stream waits, or by the host having seen it."""
        return max(self.knows.get(stream, {}).get(other, 0), self.host.get(other, 0))

    def record(self, stream) -> dict:
        """An event recorded on ``stream`` now."""
        return dict(self.knows.get(stream, {}))

    def wait_event(self, waiter, seen: dict) -> None:
        self._merge(waiter, seen)

    def wait(self, waiter, other) -> None:
        """``waiter.wait_stream(other)``: ordered after everything queued on ``other`` so far."""
        self._merge(waiter, self.record(other))

    def host_sync(self, seen: dict) -> None:
        """The host waited for an event: everything it issues from now on is ordered after ``seen``."""
        for t, pos in seen.items():
            self.host[t] = max(self.host.get(t, 0), pos)

    def work_wait(self, work, current) -> None:
        entry = self.works.pop(id(work), None)      # not kept past its wait: a Work holds its tensors
        if entry is not None and entry[0] is work:
            self._merge(current, entry[1])

    def _check_pool(self, stream) -> None:
        for accesses in self.freed.pop(stream, []):
            self.checked += 1
            late = [(s, pos, op) for s, pos, op in accesses if s != stream]
            self.cross += bool(late)
            self.cross_by.update({s for s, _, _ in late})
            for s, pos, op in late:
                if self._known(stream, s) < pos:
                    self.violations.append(f"a block of the {stream!r} pool, {op} on {s!r} (#{pos}), reused by "
                                           f"{stream!r} ordered only up to {s!r} #{self._known(stream, s)}")

    def _storages(self, tree):
        import torch
        from torch.utils._pytree import tree_leaves
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                yield t.untyped_storage()

    def _freed(self, key, pool) -> None:
        block = self.blocks.pop(key, None)
        if block is not None:
            self.freed.setdefault(pool, []).append(block[2])

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
            block = self.blocks.get(id(st))
            if block is None:
                continue
            pool, born, accesses = block
            if where != pool:             # rule 2: another stream touches a block of this pool
                self.first_uses[where] += 1
                if self._known(where, pool) < born:
                    self.violations.append(f"a block allocated on {pool!r} (#{born}) used by {func.__name__} on "
                                           f"{where!r}, ordered only up to {pool!r} #{self._known(where, pool)}")
            accesses.append((where, pos, func.__name__))
        out = func(*args, **kwargs)
        for st in self._storages(out):
            if id(st) not in inputs and id(st) not in self.blocks and st.nbytes() > 0:
                self.blocks[id(st)] = [stream, self.clock.get(stream, 0), [(where, pos, func.__name__)]]
                weakref.finalize(st, self._freed, id(st), stream)
        if collective:
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(o, torch.ScriptObject):
                    work = dist.Work.unbox(o)
                    self.works[id(work)] = (work, dict(self.knows[self.NCCL]))
        return out


def offload_backend(cuda: FakeCuda, broken: str = ""):
    """A factory for ``fake.offloading_for_config``: the offload tests' ``FakeBackend`` whose ``h2d`` / ``d2h`` are
    streams of the model (a copy inside ``use(stream)`` is an op on that stream), whose current stream is the fake
    CUDA module's (compute, or gather inside ``streams.on``), and whose events carry clocks. ``broken`` drops one
    protective wait, for the tests that prove the model fails: "h2d_wait" (``h2d`` does not wait for the
    destination's stream), "host_sync" (a synchronized event tells the host nothing)."""
    from fsdp_plugin.testing import fake

    class PoolBackend(fake.FakeBackend):
        def __init__(self, device):
            super().__init__(device)
            self.h2d, self.d2h = FakeStream("h2d", cuda.log, cuda.model), FakeStream("d2h", cuda.log, cuda.model)
            if broken == "h2d_wait":
                self.h2d.wait_event = lambda event: None

        def current(self):
            return cuda.current

        def use(self, stream):
            return cuda.stream(stream)

        def event(self, stream):
            return FakeEvent(stream, host_learns=broken != "host_sync")

    return PoolBackend


def pool_worker(rank, world, strategy, mixed, steps=2, mesh=None, offload=False, broken=""):
    """Train ``steps`` steps of the test GPT on this rank under `PoolModel` (side streams on the fake CUDA module;
    ``offload``: ``cpu_offload=True`` with `offload_backend`). ``broken`` (offload only): as `offload_backend`, or
    "release" (the copier lets a gradient chunk go with no stream wait for the copy reading it). Returns the
    losses, the violations, and what the model checked."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import fsdp_plugin as fp
    from fsdp_plugin._flat import offload as offload_mod
    from fsdp_plugin._flat import streams
    from fsdp_plugin.testing import SimWork, fake
    from _parity import make_optimizer, train
    from models import GPT, Block

    model_ = PoolModel()
    cuda = FakeCuda([], model_)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return model_.run(cuda.current.name, func, args, kwargs or {})

    if offload:          # a forked rank: patched for this process only
        fake.offload_on_cpu(offload_backend(cuda, broken))
        if broken == "release":
            offload_mod.HostCopier._release_reading = lambda self: self._reading.clear()
    torch.manual_seed(0)
    mp = {"mixed_precision": fp.MixedPrecision(param_dtype=torch.bfloat16)} if mixed else {}
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, cpu_offload=offload, **mp,
             **({"device_mesh": mesh} if mesh else {}))
    assert (model._fp_root.offload is not None) == offload
    side = streams.CommStreams(torch.device("cpu"), backend=cuda)
    for u in model._fp_root.units:
        for h in u.handles:
            h.streams = side
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
    seen = {"checked": model_.checked, "cross": model_.cross, "cross_by": dict(model_.cross_by),
            "first_uses": dict(model_.first_uses), "host": dict(model_.host)}
    return losses, model_.violations, seen
