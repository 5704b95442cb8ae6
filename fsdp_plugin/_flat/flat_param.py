"""One flat, padded parameter buffer per (unit, dtype, requires_grad) group: the paper's FlatParameter.

Layout (unsharded, ``padded`` elements): ``[p0 | gap | p1 | ... | pk | pad]``, row-aligned (see ``rows.py``):
shard rank ``r`` keeps elements ``[r*chunk, (r+1)*chunk)`` in ``flat_shard`` (the master copy, original dtype)
and every boundary that cuts a parameter cuts it between rows. Every original ``nn.Parameter`` keeps its
identity; its ``.data`` is its local piece as whole rows, ``(k, *shape[1:])`` (the full shape when whole here,
``k = 0`` when none of it is here), a view into ``flat_shard``, and its ``.grad`` the matching view into the
flat sharded gradient. Forward and backward use views of ``leaf``, an autograd leaf whose storage is freed while
sharded and refilled by the all-gather, so tensors saved for backward see the refilled values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._comm import collectives as comm
from .._comm import quantized
from .._groups.mesh import Mesh
from .._schedule.states import ShardedState
from .._reduce.usage import SlotUsage
from .._comm.trace import _traced
from .dtensor import as_parallel, local_grad, tp_spec
from .owners import choose_owners
from .packed import keeps_class, rewrap
from .rows import local_shape, piece, row_aligned_offsets
from .secondary import SecondaryShard
from . import streams


def set_param_data(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """``param.data = tensor`` that also works from the meta device (identity, attributes and, for packed
    quantized weights, the class kept: ``swap_tensors`` swaps classes too)."""
    if param.device.type == tensor.device.type:
        param.data = tensor
        return
    attrs = dict(param.__dict__)
    new = rewrap(param, tensor) if keeps_class(param) else nn.Parameter(tensor, requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, new)
    param.__dict__.update(attrs)


@dataclass
class ParamSlot:
    """One original parameter inside a flat buffer."""

    param: nn.Parameter
    fqn: str
    sites: list                  # every (module, attr_name) that registers this parameter
    shape: torch.Size
    offset: int = 0              # first element in the unsharded flat buffer (set by the handle's layout)
    local_start: int = 0         # this rank's piece is the flattened param's [local_start, local_end)
    local_end: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()


class _PendingReduce:
    """One issued gradient reduction and the buffers it owns (FSDP2's ``ReduceScatterState``): the collective's
    input and output stay referenced here until ``wait`` has ordered the current stream after the collective,
    so neither goes back to the caching allocator while a side stream (or NCCL's) may still read or write it.
    ``wait`` releases the input (``tests/test_streams.py``: the allocator model that fails when a block read on
    one stream is freed before its pool's stream has passed the read)."""

    __slots__ = ("work", "out", "keep", "replica", "gate")

    def __init__(self, work, out: torch.Tensor, keep: torch.Tensor, replica: bool = False, gate=None):
        self.work = work
        self.out = out             # this rank's reduced chunk (reduce dtype), valid after ``wait``
        self.keep = keep           # the collective's input, released only after its wait
        self.replica = replica     # hybrid's second stage: the cross-replica all-reduce of ``out``
        self.gate = gate           # its pairing (hybrid: the replica all-reduce in ``finish_reduce`` takes its tag)

    def wait(self, what: str, timeout_s) -> torch.Tensor:
        """Wait for the collective (the current stream is ordered after it), then release its input; the
        output."""
        comm.wait(self.work, what, timeout_s)
        self.keep = None
        return self.out


def _replica_gate(gate):
    """The pairing of hybrid's replica all-reduce: the reduce-scatter's identity tag or ledger code (a new
    position; issue 30), never its announcement again (the world already agreed on the unit: ``strict``)."""
    return gate if isinstance(gate, comm.Tagged) else None


class _LeafViews(torch.autograd.Function):
    """Every slot's full-shape view of a handle's leaf in one autograd node (instead of a split node, a view
    node and a Python hook per slot). Gradients of unused views arrive as None: the backward marks the
    others used and concatenates the leaf's gradient (zeros for unused slots and the padding), as the split's
    own backward would."""

    @staticmethod
    def forward(ctx, handle, leaf):
        ctx.handle = handle
        ctx.set_materialize_grads(False)
        pieces = leaf.split_with_sizes(handle._split_sizes)
        return tuple(pieces[i].view(s) for i, s in zip(handle._slot_segment, handle._shapes))

    @staticmethod
    def backward(ctx, *grads):
        return None, ctx.handle.flat_grad(grads)


class FlatParamHandle:
    """Owns one flat buffer: layout, unshard/reshard, gradient reduction."""

    def __init__(self, slots: list[ParamSlot], mesh: Mesh, dtype: torch.dtype, requires_grad: bool,
                 device: torch.device, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 shard_device: torch.device, label: str = "", timeout_s: Optional[float] = None,
                 quantization=None, offload=None, packed: bool = False):
        self.slots, self.mesh, self.dtype, self.requires_grad = slots, mesh, dtype, requires_grad
        # packed quantized bytes (``packed.py``): frozen, never cast; views are the parameters' own class
        self.packed = packed
        if packed and (requires_grad or compute_dtype != dtype or reduce_dtype != dtype or quantization is not None):
            raise AssertionError(f"unit {label!r}: packed quantized bytes must stay frozen and uncast")
        # ``fp.Quantization`` of this handle's unit collectives (``_comm/quantized.py``); floating handles only
        self.quantization = quantization if dtype.is_floating_point and quantization is not None else None
        self.label, self.timeout_s = label, timeout_s
        self.device, self.compute_dtype, self.reduce_dtype = device, compute_dtype, reduce_dtype
        self.shard_device = shard_device
        self.total = sum(s.numel for s in slots)
        n = mesh.shard_size
        offsets, self.padded = row_aligned_offsets([s.shape for s in slots], n)
        for s, o in zip(slots, offsets):
            s.offset = o
        self.chunk = self.padded // n
        self.chunk_start = mesh.shard_rank * self.chunk
        # cpu_offload: ``offload`` is the model's HostCopier (``offload.py``: pinned host buffers, side-stream copies)
        self.offload = offload
        self.flat_shard = (offload.host_tensor(self.chunk, dtype) if offload is not None
                           else torch.zeros(self.chunk, dtype=dtype, device=shard_device))
        self._aliases_shard = n == 1 and compute_dtype == dtype and shard_device == device and offload is None
        self._init_leaf()
        self._bind_local_pieces()
        self._gather: Optional[tuple] = None    # (work, source) while UNSHARDING
        self.state = ShardedState.UNSHARDED if self._aliases_shard else ShardedState.SHARDED
        self.pending_reduce: Optional[_PendingReduce] = None
        self.unsharded_grad_accum: Optional[torch.Tensor] = None   # no_sync accumulation
        self.usage = SlotUsage(len(slots))
        self.grad_divisor: Optional[int] = None   # Join, divide_by_initial_world_size=False: active ranks
        self.secondary: Optional[SecondaryShard] = None   # hpZ (``secondary.py``), set by fp.shard
        # CUDA: the all-gather and reduction side streams (``streams.py``); None on CPU (no stream, as before)
        self.streams = streams.for_device(device) if (mesh.shard_size > 1 or mesh.replicate_size > 1) else None

    # ----------------------------------------------------------------- layout
    def _init_leaf(self) -> None:
        if self._aliases_shard:
            self.leaf = self.flat_shard.data.requires_grad_(self.requires_grad)
        else:
            self.leaf = torch.empty(self.padded, dtype=self.compute_dtype, device=self.device)
            self.leaf.requires_grad_(self.requires_grad)
            self.leaf.untyped_storage().resize_(0)
        # Collectives write through this alias: its version counter is separate from the leaf's, so
        # refilling the storage does not trip autograd's saved-tensor version check.
        self._full = self.leaf.data
        self._split_sizes, self._slot_segment = self._segments()
        self._shapes = [s.shape for s in self.slots]
        # tensor-parallel slots: forward views are DTensors again (``dtensor.py``); None for plain slots
        self._tp = [tp_spec(s.param) for s in self.slots]
        self._has_tp = any(t is not None for t in self._tp)

    def _segments(self) -> tuple[list[int], list[int]]:
        """Sizes of the flat buffer's consecutive segments (slots, gaps, tail padding) and each slot's index."""
        sizes, index, pos = [], [], 0
        for s in self.slots:
            if s.offset > pos:
                sizes.append(s.offset - pos)
            index.append(len(sizes))
            sizes.append(s.numel)
            pos = s.offset + s.numel
        if self.padded > pos:
            sizes.append(self.padded - pos)
        return sizes, index

    def _bind_local_pieces(self) -> None:
        for s in self.slots:
            s.local_start, s.local_end = self.piece_of(s, self.mesh.shard_rank)
            local = self.flat_shard[self.local_slice(s)]
            s.param.grad = None      # a gradient from before fp.shard is full-shape: it fits no piece
            set_param_data(s.param, local.view(local_shape(s.shape, s.local_start, s.local_end)))
            s.param._fp_handle = self

    def piece_of(self, slot: ParamSlot, shard_rank: int) -> tuple[int, int]:
        """Shard rank ``shard_rank``'s piece ``[start, end)`` of the flattened parameter (whole rows)."""
        return piece(slot.offset, slot.numel, self.chunk, shard_rank)

    @property
    def owners(self) -> list[int]:
        """Owner shard rank of every slot (see ``owners.py``); computed once, from the layout alone."""
        if getattr(self, "_owners", None) is None:
            self._owners = choose_owners(self)
        return self._owners

    def local_slice(self, slot: ParamSlot) -> slice:
        a = slot.offset + slot.local_start - self.chunk_start
        return slice(a, a + slot.local_end - slot.local_start)

    def fill_from_full(self, slot: ParamSlot, full: torch.Tensor) -> None:
        """Copy this rank's piece of ``full`` (the whole parameter) into the shard."""
        piece = full.detach().reshape(-1)[slot.local_start:slot.local_end]
        if self.offload is not None:      # pinned masters a host-to-device copy may still be reading
            self.offload.before_host_write()
        self.flat_shard[self.local_slice(slot)].copy_(piece)

    # ---------------------------------------------------------- unshard/reshard
    def _alloc_full(self) -> None:
        storage = self._full.untyped_storage()
        nbytes = self.padded * self._full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    @property
    def is_unsharded(self) -> bool:
        return self.state is ShardedState.UNSHARDED

    @property
    def unshard_communicates(self) -> bool:
        """``unshard`` would issue an all-gather now."""
        return self.state is ShardedState.SHARDED and self.mesh.shard_size > 1

    @property
    def reduce_communicates(self) -> bool:
        """``start_reduce`` issues a collective (a shard or replica group of more than one rank)."""
        return self.mesh.shard_size > 1 or self.mesh.replicate_size > 1

    @_traced("unshard")
    def unshard(self, async_op: bool = True, gate=None, use_secondary: bool = False) -> None:
        """SHARDED -> UNSHARDING (or UNSHARDED without communication); ``wait_unshard`` before use.
        ``gate``: the all-gather's pairing announcement (``_comm.pairing``; given when it communicates).
        ``use_secondary`` (backward only): gather from hpZ's secondary slice over its group when one is held;
        otherwise a held slice is dropped (the master may have changed since it was taken)."""
        if self.state is not ShardedState.SHARDED:
            return
        held = self.secondary.take() if self.secondary is not None else None
        self._alloc_full()
        if self.mesh.shard_size == 1 and self.offload is not None:   # copied on the copier's stream; the
            self._gather = (self.offload, self.offload.to_device(self.flat_shard, self))   # stream using it waits
            self.state = ShardedState.UNSHARDING                        # in wait_unshard (``offload.fill``)
            if not async_op:
                self.wait_unshard()
            return
        if self.mesh.shard_size == 1:
            self._full.copy_(self.flat_shard.to(self.device, self.compute_dtype, non_blocking=True))
            self.state = ShardedState.UNSHARDED
            return
        with streams.on(self.streams, "gather"):     # CUDA: copy-in and issue beside the compute stream
            if held is not None and use_secondary:     # hpZ: exact, inside the secondary group, from the held slice
                src = held
                work = comm.all_gather(self._full, src, self.secondary.group, async_op=True, gate=gate,
                                       what=f"all-gather of unit {self.label!r}")
            else:
                q = self.quantization
                # int8 blocks are cut from the exact master (one rounding, not the compute cast's and the codes')
                dtype = self.dtype if quantized.applies(q, "weights", self.mesh.shard_group) else self.compute_dtype
                src = self._master_on_device(dtype)
                work = quantized.all_gather(q, self._full, src, self.mesh.shard_group, gate=gate,
                                            what=f"all-gather of unit {self.label!r}")
        self._gather = (work, src)     # src is released only after wait_unshard's wait (``streams.py``: why)
        self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def _master_on_device(self, dtype: torch.dtype) -> torch.Tensor:
        """The master shard on the device in ``dtype`` (offload: copied on the copier's stream, cast on this one)."""
        if self.offload is not None:
            return self.offload.to_device(self.flat_shard).to(dtype)
        return self.flat_shard.to(self.device, dtype, non_blocking=True)

    @_traced("wait_unshard")
    def wait_unshard(self) -> None:
        """-> UNSHARDED, from either other state."""
        if self.state is ShardedState.UNSHARDING and self.offload is not None and self._gather[0] is self.offload:
            copy, self._gather, self.state = self._gather[1], None, ShardedState.UNSHARDED   # cpu_offload, world 1
            return self.offload.fill(copy, self._full)
        if self.state is ShardedState.UNSHARDING:
            work = self._gather[0]
            self.state = ShardedState.UNSHARDED    # the buffer is ours again even if the wait raises
            comm.wait(work, f"all-gather of unit {self.label!r}", self.timeout_s)
            # the source (read by the collective on NCCL's stream) is released only once the wait ordered the
            # current stream after it; a failed wait leaves it referenced (the collective may still read it)
            self._gather = None
        elif self.state is ShardedState.SHARDED:
            self.unshard(async_op=False)

    @_traced("reshard")
    def reshard(self, keep_secondary: bool = False) -> None:
        """UNSHARDED (or UNSHARDING: a prefetch whose unit did not run) -> SHARDED, freeing the full buffer; a
        handle aliasing its shard stays UNSHARDED. A prefetch is waited for, never left in flight: it would
        otherwise be used by the next step with values from before the optimizer step. ``keep_secondary``
        (after a forward that backward follows): hpZ keeps its secondary slice first (``secondary.py``)."""
        if self.state is ShardedState.UNSHARDING:
            self.wait_unshard()
        if self._aliases_shard or self.state is not ShardedState.UNSHARDED:
            return
        if keep_secondary and self.secondary is not None:
            self.secondary.keep(self._full)
        self._full.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def drop_secondary(self) -> None:
        if self.secondary is not None:
            self.secondary.drop()

    def abandon_step(self) -> None:
        """Forget an abandoned step: finish in-flight collectives (every rank issued them), drop unreduced
        gradients and usage marks, reshard. Raises the first CollectiveError after cleaning up."""
        error = None
        # reshard() waits only for a gather already in flight: a sharded handle must not start a new one here
        # (ranks may stop in different states, so a fresh all-gather could be unmatched).
        for finish in (self.reshard, self._drop_pending_reduce):
            try:
                finish()
            except Exception as e:  # noqa: BLE001 - cleanup goes on; the first error is re-raised
                error = error or e
        self.leaf.grad, self.unsharded_grad_accum = None, None
        self.drop_secondary()
        self.usage = SlotUsage(len(self.slots))
        if error is not None:
            raise error

    def _drop_pending_reduce(self) -> None:
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            pending.wait(f"gradient reduction of unit {self.label!r}", self.timeout_s)

    def gather_master(self) -> torch.Tensor:
        """A new padded flat tensor with the full master values (original dtype; not the compute buffer)."""
        full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        src = self.flat_shard.to(self.device)
        if self.mesh.shard_size == 1:
            full.copy_(src)
        else:
            comm.all_gather(full, src, self.mesh.shard_group, kind="state_dict")
        return full

    def write_back(self, full: torch.Tensor) -> None:
        """Copy this rank's chunk of a full padded flat tensor (from ``gather_master``) into the shard."""
        if self.offload is not None:      # pinned masters a host-to-device copy may still be reading
            self.offload.before_host_write()
        self.flat_shard.copy_(full[self.chunk_start:self.chunk_start + self.chunk].to(self.flat_shard.device))

    def split_full(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Full-shape views of a padded flat tensor, one per slot."""
        pieces = full.split(self._split_sizes)
        return [pieces[i].view(s.shape) for i, s in zip(self._slot_segment, self.slots)]

    def views(self) -> list[torch.Tensor]:
        """Full-shape views of the unsharded leaf, one per slot (autograd-connected in grad mode).

        In grad mode the views come from one `_LeafViews` node, whose backward marks the slots that got a
        gradient (``SlotUsage``): autograd hands it None for a view that did not reach the loss.
        """
        if self.requires_grad and torch.is_grad_enabled() and self.slots:
            out = list(_LeafViews.apply(self, self.leaf))
        else:
            pieces = self.leaf.split_with_sizes(self._split_sizes)
            out = [pieces[i].view(shape) for i, shape in zip(self._slot_segment, self._shapes)]
            if self.packed:
                return self.as_original_class(out)
        return self.as_parallel(out) if self._has_tp else out

    def as_original_class(self, views: list) -> list:
        """Packed slots' views as their parameters' own class with its ``quant_state`` (``packed.rewrap``)."""
        return [rewrap(s.param, v) for v, s in zip(views, self.slots)]

    def as_parallel(self, views: list) -> list:
        """Per-slot views (local TP tensors) as the DTensors the model was parallelized with (plain slots as is)."""
        return [v if t is None else as_parallel(v, t) for v, t in zip(views, self._tp)]

    def flat_grad(self, grads) -> torch.Tensor:
        """The leaf's gradient from per-slot gradients (None: unused, zeros), marking used slots."""
        now = self.usage.now
        parts: list = [None] * len(self._split_sizes)   # None: zeros (gaps, padding, unused slots)
        for i, (g, seg) in enumerate(zip(grads, self._slot_segment)):
            if g is not None:
                now[i] = 1
                parts[seg] = (local_grad(g) if self._has_tp else g).reshape(-1)
        return torch.cat([torch.zeros(n, dtype=self.compute_dtype, device=self.device) if p is None else p
                          for p, n in zip(parts, self._split_sizes)])

    # ------------------------------------------------------------- gradients
    def take_unsharded_grad(self) -> Optional[torch.Tensor]:
        grad, self.leaf.grad = self.leaf.grad, None
        if self.unsharded_grad_accum is not None:
            grad = self.unsharded_grad_accum if grad is None else grad + self.unsharded_grad_accum
            self.unsharded_grad_accum = None
        return grad

    def accumulate_without_sync(self) -> None:
        grad, self.leaf.grad = self.leaf.grad, None
        if grad is not None:
            acc = self.unsharded_grad_accum
            self.unsharded_grad_accum = grad if acc is None else acc.add_(grad)

    @_traced("reduce")
    def start_reduce(self, grad: torch.Tensor, gate=None) -> None:
        """Issue the gradient reduction asynchronously; ``finish_reduce`` completes it.

        Shard groups of more than one rank reduce-scatter; a group of one (no_shard) all-reduces across
        the replicas right away; hybrid all-reduces the reduced chunk across replicas from ``finish_reduce``
        (issued after the reduce-scatter's wait: its pairing verdict covers both). ``gate``: as for ``unshard``.
        """
        what = f"gradient reduction of unit {self.label!r}"
        # Copy-in on the CURRENT stream (FSDP2's ``foreach_reduce``): the cast reads the gradient on the stream
        # that wrote it, so when the caller drops it the block returns to that stream's pool with every use
        # ordered there. Cast on the reduce stream, the block would be reused by the next unit's backward
        # before the reduce stream had read it. The reduce stream then waits for the cast (``streams.on``) and
        # the pending reduction keeps the cast input until its wait (`_PendingReduce`).
        grad = grad.to(self.reduce_dtype)
        with streams.on(self.streams, "reduce"):     # CUDA: issue beside the rest of backward
            if self.mesh.shard_size > 1:
                out = torch.empty(self.chunk, dtype=self.reduce_dtype, device=self.device)
                work = quantized.reduce_scatter(self.quantization, out, grad, self.mesh.shard_group, gate=gate,
                                                what=what)
                self.pending_reduce = _PendingReduce(work, out, grad, gate=gate)
            elif self.mesh.replicate_size > 1:
                work = quantized.all_reduce(self.quantization, grad, self.mesh.replicate_group, gate=gate,
                                            what=what, timeout_s=self.timeout_s)
                self.pending_reduce = _PendingReduce(work, grad, grad)
            else:
                self.pending_reduce = _PendingReduce(None, grad, grad)

    @_traced("wait_reduce")
    def finish_reduce(self, final: bool = True) -> bool:
        """Wait for the reduction, average across every rank, accumulate into ``shard_grad``.

        Hybrid (shard and replicate groups of more than one rank): the reduce-scatter's wait issues the
        cross-replica all-reduce of the reduced chunk; with ``final=False`` it is left in flight (the rest of
        backward overlaps it: the reduction queue calls ``finish_reduce()`` again at the end of backward) and
        True is returned; otherwise it is waited here. A tagged all-reduce (no_shard on gloo/CPU) likewise: with
        ``final=False`` its own part is summed and its phase 2 left in flight. Returns whether a reduction is
        still pending."""
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is None:
            return False
        what = "cross-replica all-reduce" if pending.replica else "gradient reduction"
        if not final and comm.advance(pending.work, f"{what} of unit {self.label!r}", self.timeout_s):
            self.pending_reduce = pending      # a tagged all-reduce's phase 2 overlaps the rest of backward
            return True
        out = pending.wait(f"{what} of unit {self.label!r}", self.timeout_s)
        if not pending.replica and self.mesh.shard_size > 1 and self.mesh.replicate_size > 1:
            # the reduce-scatter's input is released now; only the 1/S chunk stays until the all-reduce ends
            with streams.on(self.streams, "reduce"):     # CUDA: beside the rest of backward, as the reduce-scatter
                work = quantized.all_reduce(self.quantization, out, self.mesh.replicate_group,
                                            gate=_replica_gate(pending.gate),
                                            what=f"cross-replica all-reduce of unit {self.label!r}",
                                            timeout_s=self.timeout_s)
            self.pending_reduce = _PendingReduce(work, out, out, replica=True)
            if not final:
                return True
            return self.finish_reduce()
        divisor = self.grad_divisor or self.mesh.reduce_world
        if divisor > 1:
            out.div_(divisor)
        self._accumulate_shard_grad(out)
        return False

    def advance_reduce(self) -> None:
        """Take the pending reduction as far as it goes without waiting for a peer's later stage
        (``comm.advance``: a tagged all-reduce sums its part and posts phase 2); nothing else."""
        pending = self.pending_reduce
        if pending is not None:
            what = "cross-replica all-reduce" if pending.replica else "gradient reduction"
            comm.advance(pending.work, f"{what} of unit {self.label!r}", self.timeout_s)

    def _grad_base(self) -> Optional[torch.Tensor]:
        """The flat sharded gradient, found through the slots' ``p.grad`` views.

        The handle keeps no reference of its own: once the user drops every ``p.grad``
        (``zero_grad(set_to_none=True)``) the buffer is freed at once, not at the next backward. Under cpu_offload
        the copier keeps its pinned buffer and reuses it when nothing else holds it (``offload.py``).
        """
        grads = [s.param.grad for s in self.slots]
        if any(g is None for g in grads):
            return None
        base = grads[0]._base
        return base if base is not None and all(g._base is base for g in grads) else None

    def _accumulate_shard_grad(self, reduced: torch.Tensor) -> None:
        """Add the reduced chunk to ``p.grad`` of every slot; remember which slots had no gradient before
        (``SlotUsage.restore_none`` puts None back for those no rank used)."""
        if self.offload is not None:      # pinned buffers, no host wait (``offload.py``)
            return self.offload.accumulate_grad(self, reduced)
        reduced = reduced.to(self.shard_device, self.dtype)
        base = self._grad_base()
        self.usage.had_grad = [s.param.grad is not None for s in self.slots]
        if base is None:
            base = reduced
            for s, had in zip(self.slots, self.usage.had_grad):
                if had:      # some slots lost their gradient (unused, or set to None by the user)
                    base[self.local_slice(s)].add_(s.param.grad.reshape(-1))
        else:
            base.add_(reduced)
        for s in self.slots:
            s.param.grad = base[self.local_slice(s)].view(s.param.shape)

    def reduce_now(self) -> None:
        """Reduce outside backward order (every rank calls it for the same handles, in the same order):
        this rank's pending no_sync gradient, or zeros if it has none."""
        grad = self.take_unsharded_grad()
        if grad is None:
            grad = torch.zeros(self.padded, dtype=self.compute_dtype, device=self.device)
        self.start_reduce(grad)
        self.finish_reduce()

    def restore_none(self, used_anywhere: list[bool]) -> None:
        """Slots no rank used and that had no gradient before this reduction get ``p.grad = None`` again."""
        for s, used, had in zip(self.slots, used_anywhere, self.usage.had_grad):
            if not used and not had:
                s.param.grad = None

