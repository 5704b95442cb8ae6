"""Lay the engine's schedule (``_unit.py``/``_root.py``) over a recorded activation curve, for one strategy
and world size: which units are unsharded when, which gradients wait for their reduction, and the wire bytes
each collective moves (``_collectives.ring_bytes``, the counters' own formula).

Memory is per rank and all ranks are alike (every shard has ``chunk`` elements, padding included).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import _root
from .._collectives import ring_bytes

# The engine's own bound on reductions in flight (read, not copied, so the replay follows the engine).
_MAX_PENDING_REDUCES = getattr(_root, "_MAX_PENDING_REDUCES", 1)


@dataclass
class Layout:
    """How one configuration places a handle: shard group size S, replicas R, dtypes, where shards live."""

    strategy: str
    world: int
    shard_size: int
    replicate_size: int
    compute_dtype: Optional[torch.dtype]
    reduce_dtype: Optional[torch.dtype]
    prefetch_depth: int
    backward_prefetch: bool
    forward_prefetch: bool
    cpu_offload: bool
    staging: bool = False        # the backend stages a full-size copy while a gather/reduce-scatter is in flight

    def compute(self, h) -> torch.dtype:
        return self.compute_dtype if (self.compute_dtype and h.dtype.is_floating_point) else h.dtype

    def reduce(self, h) -> torch.dtype:
        if self.reduce_dtype and h.dtype.is_floating_point:
            return self.reduce_dtype
        return self.compute(h)

    def aliases(self, h) -> bool:
        return self.shard_size == 1 and self.compute(h) == h.dtype and not self.cpu_offload


@dataclass
class Moment:
    """Bytes by category at the peak moment (device memory of one rank)."""

    static: int = 0
    unsharded: int = 0
    reducing: int = 0
    grad_shards: int = 0
    activations: int = 0
    unsharded_units: tuple = ()

    @property
    def total(self) -> int:
        return self.static + self.unsharded + self.reducing + self.grad_shards + self.activations


@dataclass
class ReplayResult:
    peak: Moment
    max_unsharded: int = 0
    max_unsharded_units: tuple = ()
    max_reducing: int = 0
    wire: Counter = field(default_factory=Counter)     # bytes per step per rank, by collective kind
    calls: Counter = field(default_factory=Counter)


class _Sim:
    def __init__(self, units, handles, lay: Layout, static: int):
        self.units, self.handles, self.lay = units, handles, lay
        self.static = static
        self.full = [0 if lay.aliases(h) else h.padded(lay.shard_size) * lay.compute(h).itemsize for h in handles]
        self.unsh = [lay.aliases(h) for h in handles]
        self.unsharded = self.reducing = self.grad_shards = 0
        self.inflight: dict[int, int] = {}     # handle -> staging bytes of its all-gather until it is waited on
        self.pending: deque = deque()
        self.reduce_bytes: dict[int, int] = {}
        self.has_grad: set = set()
        self.depth = [0] * len(units)
        self.started: set = set()
        self.order: list = []
        self.act = 0
        self.res = ReplayResult(Moment())

    # ------------------------------------------------------------ accounting
    def check(self, act: Optional[int] = None) -> None:
        act = self.act if act is None else act
        m = Moment(self.static, self.unsharded, self.reducing, self.grad_shards, act)
        if m.total > self.res.peak.total:
            m.unsharded_units = self._unsharded_names()
            self.res.peak = m
        if self.unsharded > self.res.max_unsharded:
            self.res.max_unsharded, self.res.max_unsharded_units = self.unsharded, self._unsharded_names()
        self.res.max_reducing = max(self.res.max_reducing, self.reducing)

    def _unsharded_names(self) -> tuple:
        return tuple(u.name for u in self.units if any(self.unsh[h] and self.full[h] for h in u.handles))

    def comm(self, kind: str, elems: int, itemsize: int, n: int, factor: int = 1) -> None:
        if n > 1:
            self.res.calls[kind] += 1
            self.res.wire[kind] += ring_bytes(elems, itemsize, n, factor)

    # ------------------------------------------------------------ state moves
    def unshard(self, u: int) -> None:
        for h in self.units[u].handles:
            if self.unsh[h]:
                continue
            self.unsh[h] = True
            self.unsharded += self.full[h]
            spec = self.handles[h]
            self.comm("all_gather", spec.padded(self.lay.shard_size), self.lay.compute(spec).itemsize,
                      self.lay.shard_size)
            if self.lay.staging and self.lay.shard_size > 1:
                self.inflight[h] = self.full[h]
                self.reducing += self.full[h]
        self.check()

    def use(self, u: int) -> None:
        """The unit waits for its all-gathers (wait_and_use_views): their staging is released."""
        for h in self.units[u].handles:
            self.reducing -= self.inflight.pop(h, 0)

    def reshard_handle(self, h: int) -> None:
        if self.unsh[h] and self.full[h]:
            self.unsh[h] = False
            self.unsharded -= self.full[h]

    def grad_ready(self, h: int) -> None:
        """The unit's flat gradient (compute dtype) is built while its per-parameter pieces still exist."""
        spec, lay = self.handles[h], self.lay
        self.reducing += spec.padded(lay.shard_size) * lay.compute(spec).itemsize
        self.check()

    def grads_dropped(self, h: int) -> None:
        """post-backward: cast to the reduce dtype, issue the reduction, keep one in flight, reshard."""
        spec, lay = self.handles[h], self.lay
        padded = spec.padded(lay.shard_size)
        g_compute = padded * lay.compute(spec).itemsize
        g_reduce = padded * lay.reduce(spec).itemsize
        if lay.reduce(spec) != lay.compute(spec):
            self.reducing += g_reduce
            self.check()
            self.reducing -= g_compute
        held = g_reduce
        if lay.shard_size > 1:
            held += spec.chunk(lay.shard_size) * lay.reduce(spec).itemsize
            held += g_reduce if lay.staging else 0
            self.comm("reduce_scatter", padded, lay.reduce(spec).itemsize, lay.shard_size)
        elif lay.replicate_size > 1:
            self.comm("all_reduce", padded, lay.reduce(spec).itemsize, lay.replicate_size, factor=2)
        self.reducing += held - g_reduce
        self.reduce_bytes[h] = held
        self.check()
        self.pending.append(h)
        while len(self.pending) > _MAX_PENDING_REDUCES:
            self.finish(self.pending.popleft())
        self.reshard_handle(h)

    def finish(self, h: int) -> None:
        spec, lay = self.handles[h], self.lay
        chunk = spec.chunk(lay.shard_size)
        if lay.shard_size > 1 and lay.replicate_size > 1:
            self.comm("all_reduce", chunk, lay.reduce(spec).itemsize, lay.replicate_size, factor=2)
        self.reducing -= self.reduce_bytes.pop(h)
        if h not in self.has_grad and not lay.cpu_offload:
            self.has_grad.add(h)
            self.grad_shards += chunk * spec.dtype.itemsize
            self.check()

    # ------------------------------------------------------------ events
    def pre_forward(self, u: int, in_bwd: bool) -> None:
        self.unshard(u)
        self.use(u)
        if self.lay.forward_prefetch and not in_bwd and u in self.order:
            i = self.order.index(u)
            for nxt in self.order[i + 1:i + 1 + self.lay.prefetch_depth]:
                self.unshard(nxt)

    def post_forward(self, u: int, in_bwd: bool) -> None:
        keep_sharded = self.lay.strategy in ("full_shard", "hybrid_shard") and u != 0
        if not in_bwd and keep_sharded:
            for h in self.units[u].handles:
                self.reshard_handle(h)

    def pre_backward(self, u: int) -> None:
        if u in self.started:
            return
        self.started.add(u)
        self.unshard(u)
        self.use(u)
        if self.lay.backward_prefetch and u in self.order:
            i = self.order.index(u)
            for nxt in reversed(self.order[max(0, i - self.lay.prefetch_depth):i]):
                if nxt not in self.started:
                    self.unshard(nxt)

    def end_backward(self) -> None:
        while self.pending:
            self.finish(self.pending.popleft())
        for u in range(len(self.units)):
            self.use(u)                  # a prefetch nobody used is waited on by the reshard
        for h in range(len(self.handles)):
            self.reshard_handle(h)
        self.started.clear()


def replay(units, handles, timeline, lay: Layout, static: int, optimizer_step_extra: int) -> ReplayResult:
    """Peak bytes per rank over one steady-state step (optimizer state exists from the start).

    ``static``: bytes alive all step (parameter shards, optimizer state, buffers, the input batch).
    ``optimizer_step_extra``: temporaries of ``optimizer.step()`` (added once gradients are all reduced).
    """
    sim = _Sim(units, handles, lay, static)
    for ev in timeline.events:          # the execution order the engine freezes after the first forward
        if ev.kind == "pre_forward" and not ev.in_backward and ev.index not in sim.order:
            sim.order.append(ev.index)
    for ev in timeline.events:
        sim.act = ev.act_max
        sim.check()                      # the largest activation level between the previous event and this one
        sim.act = ev.act_now
        if ev.kind == "pre_forward":
            sim.pre_forward(ev.index, ev.in_backward)
        elif ev.kind == "post_forward":
            sim.post_forward(ev.index, ev.in_backward)
        elif ev.kind == "pre_backward":
            sim.pre_backward(ev.index)
        elif ev.kind == "grad_ready":
            sim.grad_ready(ev.index)
        elif ev.kind == "grads_dropped":
            sim.grads_dropped(ev.index)
        elif ev.kind == "end_backward":
            sim.end_backward()
        sim.check()
    sim.act = timeline.act_end
    sim.static += optimizer_step_extra   # optimizer.step(): every gradient shard plus the step's temporaries
    sim.check()
    return sim.res
