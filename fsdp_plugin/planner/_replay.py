"""Lay the engine's schedule over a recorded activation curve, for one strategy and world size: which units
are unsharded when, which gradients wait for their reduction, and the wire bytes each collective moves
(``_collectives.ring_bytes``, the counters' own formula).

The schedule is the engine's, not a copy of its rules: a real ``RootState`` (``_root.py``) holds the replay's
stand-in units and handles and decides the forward/backward prefetches (``after_unshard_in_forward``,
``prefetch_backward``: e.g. the root prefetches the last unit, whose backward follows the root's head), how
many reductions stay in flight (``Reduction.enqueue``: none once the root's gradient is next) and the prefetch
depth; ``unit_policy`` (``_strategy.py``) decides which units reshard after forward, and the root which one
keeps its parameters to its backward anyway (``reshards_after_forward``: not the last). The stand-ins only
account bytes. Memory is per rank and all ranks are alike (every shard has ``chunk`` elements, padding
included).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from .._comm import quantized
from .._comm.collectives import inflight_host_bytes, ring_bytes
from .._schedule.protocols import ReducingHandle, ScheduledUnit
from .._schedule.root import RootState
from .._build.shard import handle_dtypes
from .._build.strategy import secondary_size, unit_policy
from ._links import off_node_peers
from ..config import ShardingConfig


# Linux's default ceiling of a TCP socket's autotuned send buffer (``net.ipv4.tcp_wmem``'s third field): what one
# gloo send can write on the calling thread before its I/O thread takes over (`_Sim._sync_send_bytes`).
SOCKET_SEND_BUFFER = 4 * 2**20


@dataclass
class Layout:
    """How one configuration places a handle: shard group size S, replicas R, dtypes, where shards live."""

    config: ShardingConfig
    world: int
    shard_size: int
    replicate_size: int
    staging: bool = False        # gloo on CPU: collectives take the point-to-point path (_collectives)
    per_node: int = 0            # ranks per node (0: one node); in-node collectives stay exact under quantization

    def n(self, h) -> int:
        """The shard group size of handle ``h``: an experts handle (``expert_parallel``) shards its local experts
        over ``shard_size / E`` ranks (``_experts/layout.py``: efsdp), every other over the shard group."""
        return self.shard_size // h.ep if h.ep > 1 else self.shard_size

    @property
    def strategy(self) -> str:
        return self.config.sharding_strategy

    @property
    def cpu_offload(self) -> bool:
        return self.config.cpu_offload

    def compute(self, h) -> torch.dtype:
        if h.packed:     # quantized bytes: never cast (``_build/shard.py``, ``_build_handle``)
            return h.dtype
        return handle_dtypes(self.config.mixed_precision, h.dtype, h.fp32)[0]

    def reduce(self, h) -> torch.dtype:
        if h.packed:
            return h.dtype
        return handle_dtypes(self.config.mixed_precision, h.dtype, h.fp32)[1]

    @property
    def tagged_all_reduce(self) -> bool:
        """The engine's exact all-reduces are tagged point to point (``root.pairing_mode`` "tags"), summed by the
        engine's own kernels and holding receive buffers (``inflight_host_bytes``); elsewhere gloo's or NCCL's
        own, in place."""
        return self.staging and self.config.pairing_check == "auto"

    @property
    def secondary(self) -> int:
        """hpZ's secondary group size (0: none), as fp.shard decides it (``strategy.secondary_size``)."""
        return secondary_size(self.config, self.shard_size)

    def aliases(self, h) -> bool:
        """The engine's FlatParamHandle._aliases_shard: the leaf is the shard itself (never gathered)."""
        return self.n(h) == 1 and self.compute(h) == h.dtype and not self.cpu_offload

    def quantized(self, h, what: str, group: str = "shard") -> Optional[int]:
        """The block size when ``ShardingConfig.quantization`` quantizes this handle's ``what`` ("weights" or
        "gradients"; floating handles only, as the engine's ``FlatParamHandle.quantization``) over ``group``,
        else None: as ``_comm.quantized.applies``, a group inside one node of a multi-node job stays exact."""
        q = self.config.quantization
        if q is None or not getattr(q, what) or not h.dtype.is_floating_point or h.packed:
            return None
        k = self.per_node
        if 0 < k < self.world and off_node_peers(group, self.world, k, self.shard_size, self.replicate_size,
                                                 self.secondary)[1] == 0:
            return None
        return q.block_size

    def casts_source(self, h) -> bool:
        """``unshard`` copies the shard (to the compute dtype / device) before gathering it."""
        return self.compute(h) != h.dtype or self.cpu_offload




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
    # the same bytes and calls by (kind, group): group "shard", "replicate" or "secondary" (hpZ); the link
    # pricing (``_links.py``) places each group on the node topology
    wire_groups: Counter = field(default_factory=Counter)
    calls_groups: Counter = field(default_factory=Counter)
    max_secondary: int = 0   # hpZ: most bytes of secondary shards held at once (inside ``unsharded``)
    engine_bytes: int = 0   # bytes read+written by the engine's own kernels (casts, flat gradients), per step
    quantized_elems: int = 0     # elements quantized (stochastic rounding: the costlier one) per step
    dequantized_elems: int = 0   # elements dequantized per step
    link_sync_bytes: int = 0     # gloo/CPU: bytes to other nodes the training thread writes itself (`_sync_send_bytes`)
    # bytes to other nodes (per rank) of collectives waited with no compute since their issue (`_Sim.waited`):
    # the root's first all-gather, the reductions issued after backward's last kernel; no compute hides them
    exposed_inter_bytes: int = 0
    # cpu_offload (issue 49, ``_flat/offload.py``): master shards copied host -> device (master dtype, once per
    # unshard) and reduced gradient chunks copied device -> host (master dtype, once per finished reduction)
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_backward_bytes: int = 0      # the part of h2d_bytes copied during backward (units gathered again)
    # per unit, the unshards that gathered something; per handle, the reductions started (``_experts.py`` prices
    # the experts' collectives with and without expert parallelism from them)
    unit_gathers: Counter = field(default_factory=Counter)
    reductions: Counter = field(default_factory=Counter)


class _SimUnit(ScheduledUnit):
    """A `ScheduledUnit` (what ``RootState`` reads of a unit) backed by the replay, with its policy
    (``reshard_policy``) for ``RootState.reshard_table``."""

    def __init__(self, sim: "_Sim", index: int, name: str, reshard_policy: bool, some_ranks: bool = False):
        self.sim, self.index, self.name = sim, index, name
        self.reshard_policy = reshard_policy and not some_ranks
        self.some_ranks = some_ranks

    @property
    def in_backward(self) -> bool:
        return self.index in self.sim.started

    def unshard(self) -> None:
        self.sim.unshard(self.index)


class _SimHandle(ReducingHandle):
    """A `ReducingHandle` (what ``Reduction.enqueue`` calls on a handle) backed by the replay."""

    def __init__(self, sim: "_Sim", index: int):
        self.sim, self.index = sim, index

    def start_reduce(self, _grad) -> None:
        self.sim.start_reduce(self.index)

    def finish_reduce(self, final: bool = True) -> bool:
        return self.sim.finish(self.index, final)

    def advance_reduce(self) -> None:
        pass


class _Sim:
    def __init__(self, units, handles, lay: Layout, static: int):
        self.units, self.handles, self.lay = units, handles, lay
        self.static = static
        self.full = [0 if lay.aliases(h) else h.padded(lay.n(h)) * lay.compute(h).itemsize for h in handles]
        self.unsh = [lay.aliases(h) for h in handles]
        self.unsharded = self.reducing = self.grad_shards = 0
        self.inflight: dict[int, int] = {}     # handle -> bytes its all-gather holds until it is waited on
        self.reduce_bytes: dict[int, int] = {}
        self.replicating: set = set()          # hybrid handles whose cross-replica all-reduce is in flight
        self.secondary: dict[int, int] = {}    # hpZ: handle -> bytes of its secondary slice, forward to backward
        self.has_grad: set = set()
        self.started: set = set()
        self.act = 0
        self.epoch = 0                         # compute segments so far (`replay` counts the fake run's events)
        self.issued_inter = 0                  # bytes to other nodes issued so far, per rank
        self.link_pending: dict = {}           # (what, handle) -> (epoch, inter bytes) of an unwaited collective
        self.res = ReplayResult(Moment())
        cfg = lay.config
        self.sim_units = [_SimUnit(self, i, u.name, unit_policy(cfg, None, u.fqn, u.module).reshard_after_forward,
                                   u.some_ranks) for i, u in enumerate(units)]
        self.sim_handles = [_SimHandle(self, h) for h in range(len(handles))]
        self.root = RootState(cfg, None, torch.device("cpu"))
        self.root.units = list(self.sim_units)

    def freeze_order(self, order: list) -> None:
        """The execution order the engine records in the first forward and follows from then on."""
        self.root.freeze_order([self.sim_units[i] for i in order])

    # ------------------------------------------------------------ accounting
    def check(self, act: Optional[int] = None, extra: int = 0) -> None:
        act = self.act if act is None else act
        m = Moment(self.static, self.unsharded, self.reducing + extra, self.grad_shards, act)
        if m.total > self.res.peak.total:
            m.unsharded_units = self._unsharded_names()
            self.res.peak = m
        if self.unsharded > self.res.max_unsharded:
            self.res.max_unsharded, self.res.max_unsharded_units = self.unsharded, self._unsharded_names()
        self.res.max_reducing = max(self.res.max_reducing, self.reducing + extra)

    def _unsharded_names(self) -> tuple:
        return tuple(u.name for u in self.units if any(self.unsh[h] and self.full[h] for h in u.handles))

    def comm(self, kind: str, elems: int, itemsize: int, n: int, factor: int = 1, group: str = "shard") -> None:
        if n > 1:
            nbytes = ring_bytes(elems, itemsize, n, factor)
            self.res.calls[kind] += 1
            self.res.wire[kind] += nbytes
            self.res.calls_groups[(kind, group)] += 1
            self.res.wire_groups[(kind, group)] += nbytes
            self.res.link_sync_bytes += self._sync_send_bytes(nbytes, n, factor, group)
            self.issued_inter += self._inter(nbytes, n, group)

    def _inter(self, nbytes: int, n: int, group: str) -> int:
        lay = self.lay
        if not 0 < lay.per_node < lay.world:
            return 0
        off = off_node_peers(group, lay.world, lay.per_node, lay.shard_size, lay.replicate_size, lay.secondary)[1]
        return nbytes * off // (n - 1)

    def issued(self, key, since: int) -> None:
        """The collective(s) just issued for ``key`` (their bytes to other nodes: ``issued_inter - since``)."""
        if self.issued_inter > since:
            self.link_pending[key] = (self.epoch, self.issued_inter - since)

    def waited(self, key) -> None:
        """``key``'s collective is waited: exposed when no compute segment began since it was issued."""
        epoch, nbytes = self.link_pending.pop(key, (None, 0))
        if epoch == self.epoch:
            self.res.exposed_inter_bytes += nbytes

    def _sync_send_bytes(self, nbytes: int, n: int, factor: int, group: str) -> int:
        """Bytes of this collective's messages to other nodes that the training thread itself writes on gloo/CPU.
        The point-to-point collectives send every peer one message per phase (all-reduce beyond two ranks: two
        phases), and gloo's TCP pair writes a message on the calling thread until the socket's send buffer is
        full (Linux autotunes it up to ``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default), leaving the rest to its
        I/O thread: so per message ``min(bytes, SOCKET_SEND_BUFFER)`` of CPU copy that no compute hides."""
        lay = self.lay
        if not lay.staging or not 0 < lay.per_node < lay.world:
            return 0
        off = off_node_peers(group, lay.world, lay.per_node, lay.shard_size, lay.replicate_size, lay.secondary)[1]
        phases = 2 if factor == 2 and n > 2 else 1
        msg = nbytes // (phases * (n - 1))
        return phases * off * min(msg, SOCKET_SEND_BUFFER)

    def gather_comm(self, spec) -> int:
        """A unit all-gather: exact, or int8 rows + scales (``_comm/quantized.all_gather``); returns the bytes of
        this rank's row, which the point-to-point all-gather copies into the gathered buffer."""
        lay, n = self.lay, self.lay.n(spec)
        block = lay.quantized(spec, "weights")
        if block is None:
            self.comm("all_gather", spec.padded(n), lay.compute(spec).itemsize, n)
            return spec.chunk(n) * lay.compute(spec).itemsize
        row = quantized.payload_elems(spec.chunk(n), block)
        self.comm(quantized.WEIGHTS_KIND, n * row, 1, n)
        self.quantize_cost(spec.chunk(n), n * spec.chunk(n))
        # the int8 staging rows (``empty``, priced at its output); the wait dequantizes them into the full buffer
        # (``dequantize_into``, priced per element)
        self.res.engine_bytes += n * row
        return row

    def reduce_comm(self, spec, op: str, elems: int, n: int, group: str = "shard") -> None:
        """A gradient reduction of ``elems`` over ``n`` ranks: exact, or (``_comm/quantized``) one exchange of
        int8 rows (reduce-scatter), followed by an all-gather of the re-quantized sums (all-reduce)."""
        block = self.lay.quantized(spec, "gradients", group)
        size = self.lay.reduce(spec).itemsize
        if block is None:
            self.comm(op, elems, size, n, factor=2 if op == "all_reduce" else 1, group=group)
            if op == "all_reduce" and n > 1:
                self.res.engine_bytes += self._all_reduce_kernel_bytes(elems * size, n)
            return
        bits = quantized.bits_of(self.lay.config.quantization, "gradients")
        kind = quantized.gradients_kind(bits)
        if op == "all_reduce" and n == 2:       # _pair_all_reduce: one all-gather of both quantized tensors
            self.comm(kind, n * quantized.payload_elems(elems, block, bits), 1, n, group=group)
            self.quantize_cost(elems, 2 * elems)
            row = quantized.payload_elems(elems, block, bits)
            # both rows' staging (``empty``), this rank's row copied in (gloo/CPU point to point); the wait sums
            # both dequantized into the gradient (``dequantize_into``, priced per element)
            self.res.engine_bytes += 2 * row + 3 * row * self.lay.staging
            return
        length = -(-elems // n)
        row = quantized.payload_elems(length, block, bits)
        for _ in range(2 if op == "all_reduce" else 1):
            self.comm(kind, n * row, 1, n, group=group)
        self.quantize_cost(n * length, (n - 1) * length)       # the exchange: every row out, the peers' in
        # the received rows (``empty_like`` of the sent ones: argument and output), this rank's own row copied
        # (gloo/CPU point to point); the wait sums them into the output (``dequantize_into``, per element)
        self.res.engine_bytes += 2 * n * row + 3 * row * self.lay.staging
        if op == "all_reduce":                                 # the re-quantized sums: one row out, all in
            self.quantize_cost(length, n * length)

    def _all_reduce_kernel_bytes(self, nbytes: int, n: int) -> int:
        """The engine's own kernels of an exact all-reduce of ``nbytes`` on gloo/CPU (`_P2PAllReduce`: a receive
        buffer per peer's part, 1/N of the tensor, ``empty_like`` priced at its argument and output, then the sum
        of the parts into this rank's own, ``add_`` read both and write one, and above two ranks the copy of the
        sum into place on N−1 of N ranks; at two ranks `_P2PPairSum`: the same with the whole tensor as the
        part); NCCL and gloo's native ring sum inside the collective."""
        if not self.lay.tagged_all_reduce:
            return 0
        part = nbytes // n if n > 2 else nbytes
        return (n - 1) * (2 * part + 3 * part) + (3 * part * (n - 1) // n if n > 2 else 0)

    def quantize_cost(self, quantized_elems: int, dequantized_elems: int) -> None:
        """The quantization's own kernels, priced by the calibration's measured rates (`_time.predict`)."""
        self.res.quantized_elems += quantized_elems
        self.res.dequantized_elems += dequantized_elems

    # ------------------------------------------------------------ state moves (FlatParamHandle's bytes)
    def unshard(self, u: int) -> None:
        if any(not self.unsh[h] for h in self.units[u].handles):
            self.res.unit_gathers[u] += 1
        for h in self.units[u].handles:
            if self.unsh[h]:
                continue
            self.unsh[h] = True
            self.unsharded += self.full[h]
            spec, lay = self.handles[h], self.lay
            n = lay.n(spec)
            src = spec.chunk(n) * lay.compute(spec).itemsize if lay.casts_source(spec) else 0
            if lay.cpu_offload:
                copied = spec.chunk(n) * spec.dtype.itemsize
                self.res.h2d_bytes += copied
                self.res.h2d_backward_bytes += copied if self.root.in_backward else 0
            if src:
                self.res.engine_bytes += src + spec.chunk(n) * spec.dtype.itemsize
            if n == 1:
                self.check(extra=src)          # the cast copy, gone once copied into the full buffer
                continue
            held_secondary = self.secondary.pop(h, 0)
            since = self.issued_inter
            if held_secondary:
                self.unsharded -= held_secondary
            if held_secondary and self.root.in_backward:     # hpZ: gathered inside the secondary group
                self.comm("all_gather", spec.padded(n), lay.compute(spec).itemsize, lay.secondary,
                          group="secondary")
                src = held_secondary                         # the slice is the gather's source until its wait
                own = held_secondary
            else:
                own = self.gather_comm(spec)
            # gloo/CPU point-to-point all-gather copies this rank's row into the gathered buffer (NCCL: in place);
            # bytes as the fake run's rule prices a copy_: source, destination read and written
            self.res.engine_bytes += 3 * own * lay.staging
            self.issued(("gather", h), since)
            held = src + inflight_host_bytes("all_gather", self.full[h], n, lay.staging)
            self.inflight[h] = held
            self.reducing += held
        self.check()

    def use(self, u: int) -> None:
        """The unit waits for its all-gathers (wait_and_use_views): what they held is released."""
        for h in self.units[u].handles:
            self.reducing -= self.inflight.pop(h, 0)
            self.waited(("gather", h))

    def reshard_handle(self, h: int) -> None:
        self.reducing -= self.inflight.pop(h, 0)     # reshard waits for a prefetch that was not used
        self.waited(("gather", h))
        if self.unsh[h] and self.full[h]:
            self.unsh[h] = False
            self.unsharded -= self.full[h]

    def grad_ready(self, h: int) -> None:
        """The unit's flat gradient (compute dtype) is built while its per-parameter pieces still exist."""
        spec, lay = self.handles[h], self.lay
        flat = spec.padded(lay.n(spec)) * lay.compute(spec).itemsize
        self.reducing += flat
        self.res.engine_bytes += 2 * flat      # torch.cat of the pieces: read them, write the flat gradient
        self.check()

    def start_reduce(self, h: int) -> None:
        """FlatParamHandle.start_reduce: cast to the reduce dtype, issue the reduction; the pending reduction
        keeps the cast gradient, this rank's output chunk and (gloo) the peers' received chunks until finished."""
        spec, lay = self.handles[h], self.lay
        self.res.reductions[h] += 1
        n = lay.n(spec)
        padded = spec.padded(n)
        g_compute, g_reduce = padded * lay.compute(spec).itemsize, padded * lay.reduce(spec).itemsize
        cast = lay.reduce(spec) != lay.compute(spec)
        held = g_reduce if cast else 0                 # without a cast the pending one is the flat gradient
        self.res.engine_bytes += (g_compute + g_reduce) if cast else 0
        self.res.engine_bytes += self._reduce_kernel_bytes(spec)
        since = self.issued_inter
        if n > 1:
            held += spec.chunk(n) * lay.reduce(spec).itemsize
            held += inflight_host_bytes("reduce_scatter", g_reduce, n, lay.staging)
            self.reduce_comm(spec, "reduce_scatter", padded, n)
        elif lay.replicate_size > 1:
            held += self._all_reduce_buffer(spec, g_reduce, "replicate")
            self.reduce_comm(spec, "all_reduce", padded, lay.replicate_size, group="replicate")
        self.issued(("reduce", h), since)
        self.reducing += held
        self.reduce_bytes[h] = held + (0 if cast else g_compute)
        self.check()

    def _all_reduce_buffer(self, spec, nbytes: int, group: str) -> int:
        """The receive buffer an exact tagged all-reduce of ``nbytes`` holds while in flight (0 when quantized:
        its staging is priced in ``reduce_comm``). Held to the reduction's wait: exact at two replicas; the
        ring's parts above are freed a unit earlier (phase 1), which this over-counts."""
        if self.lay.quantized(spec, "gradients", group) is not None or not self.lay.tagged_all_reduce:
            return 0
        return inflight_host_bytes("all_reduce", nbytes, self.lay.replicate_size, True)

    def _reduce_kernel_bytes(self, spec) -> int:
        """The engine's own arithmetic around a reduction, priced by the fake run's rule (`op_cost`): the
        gloo/CPU point-to-point reduce-scatter sums the N chunks (``torch.add(.., out=)`` 4 chunks, then N - 2
        ``add_`` of 3; NCCL sums inside the collective), finish_reduce divides the reduced gradient by the world
        (``div_``: 2)."""
        lay = self.lay
        size = lay.reduce(spec).itemsize
        n = lay.n(spec)
        chunk = spec.chunk(n) * size
        summed = (4 + 3 * (n - 2)) * chunk if lay.staging and n > 1 else 0
        if summed and lay.quantized(spec, "gradients") is None:     # the receive buffer and the output chunk:
            summed += n * chunk                                      # ``empty``, priced at its output's bytes
        elif summed:                         # the quantized exchange sums in reduce_comm; the output chunk's empty
            summed = chunk
        averaged = 2 * (chunk if n > 1 else spec.padded(n) * size) if lay.world > 1 else 0
        return summed + averaged

    def grads_dropped(self, h: int) -> None:
        """The engine's post_backward: enqueue the reduction (RootState finishes older ones), then the
        compute-dtype gradient is dropped (if a cast was made) and the handle resharded."""
        spec, lay = self.handles[h], self.lay
        self.root.reduction.enqueue(self.sim_handles[h], None, self.sim_units[spec.unit])
        if lay.reduce(spec) != lay.compute(spec):
            self.reducing -= spec.padded(lay.n(spec)) * lay.compute(spec).itemsize
        if not self.units[spec.unit].some_ranks:      # those stay unsharded to the end of backward
            self.reshard_handle(h)
        self.check()

    def finish(self, h: int, final: bool = True) -> bool:
        """FlatParamHandle.finish_reduce: hybrid's reduce-scatter wait issues the cross-replica all-reduce, left
        in flight (holding the reduced chunk) to the end of backward unless ``final``; True while it is."""
        spec, lay = self.handles[h], self.lay
        chunk = spec.chunk(lay.n(spec))
        self.waited(("reduce", h))
        if lay.n(spec) > 1 and lay.replicate_size > 1 and h not in self.replicating:
            since = self.issued_inter
            self.reduce_comm(spec, "all_reduce", chunk, lay.replicate_size, group="replicate")
            self.issued(("replicate", h), since)
            kept = chunk * lay.reduce(spec).itemsize
            kept += self._all_reduce_buffer(spec, kept, "replicate")
            self.reducing -= self.reduce_bytes[h] - kept
            self.reduce_bytes[h] = kept
            self.replicating.add(h)
            if not final:
                return True
        self.replicating.discard(h)
        self.waited(("replicate", h))
        self.reducing -= self.reduce_bytes.pop(h)
        if lay.cpu_offload:
            self.res.d2h_bytes += chunk * spec.dtype.itemsize
        if h not in self.has_grad and not lay.cpu_offload:
            self.has_grad.add(h)
            self.grad_shards += chunk * spec.dtype.itemsize
            self.check()
        return False

    # ------------------------------------------------------------ events (Unit's hooks)
    def pre_forward(self, u: int) -> None:
        self.unshard(u)
        self.use(u)
        self.root.after_unshard_in_forward(self.sim_units[u])

    def post_forward(self, u: int, in_bwd: bool) -> None:
        if not in_bwd and self.root.reshards_after_forward(self.sim_units[u]):
            for h in self.units[u].handles:
                keep = self.lay.secondary and u != 0 and self.unsh[h] and self.full[h] \
                    and not self.units[u].some_ranks
                self.reshard_handle(h)
                if keep:          # hpZ: the secondary slice (compute dtype) stays until the backward gather
                    self.secondary[h] = self.full[h] // self.lay.secondary
                    self.res.engine_bytes += 2 * self.secondary[h]      # cloned from the full buffer
                    self.unsharded += self.secondary[h]
                    self.res.max_secondary = max(self.res.max_secondary, sum(self.secondary.values()))

    def pre_backward(self, u: int) -> None:
        if u in self.started:
            return
        self.started.add(u)
        self.root.enter_backward()       # recomputation from now on: no forward prefetch (the engine's rule)
        self.unshard(u)
        self.use(u)
        self.root.prefetch_backward(self.sim_units[u])

    def end_backward(self) -> None:
        self.root.reduction.finish_pending()
        for h in range(len(self.handles)):
            self.reshard_handle(h)
        self.unsharded -= sum(self.secondary.values())
        self.secondary.clear()
        self.started.clear()
        self.root.exit_backward()


def replay(units, handles, timeline, lay: Layout, static: int, optimizer_step_extra: int) -> ReplayResult:
    """Peak bytes per rank over one steady-state step (optimizer state exists from the start).

    ``static``: bytes alive all step (parameter shards, optimizer state, buffers, the input batch).
    ``optimizer_step_extra``: temporaries of ``optimizer.step()`` (added once gradients are all reduced).
    """
    sim = _Sim(units, handles, lay, static)
    order: list = []
    for ev in timeline.events:          # the execution order the engine freezes after the first forward
        if ev.kind == "pre_forward" and not ev.in_backward and ev.index not in order \
                and not units[ev.index].some_ranks:     # the engine keeps them out of its order too
            order.append(ev.index)
    sim.freeze_order(order)
    for ev in timeline.events:
        sim.act = ev.act_max
        sim.check()                      # the largest activation level between the previous event and this one
        sim.act = ev.act_now
        if ev.kind not in ("grads_dropped", "end_backward"):    # the fake run computed since the last event
            sim.epoch += 1
        if ev.kind == "pre_forward":
            sim.pre_forward(ev.index)
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
