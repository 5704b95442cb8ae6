"""State shared by all units of one sharded model: execution order, prefetch, pending reductions, and
the end-of-backward callback that waits for reductions and reshards whatever is still unsharded."""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from .._comm import native, pairing, tagged, transport
from .._comm.transport import Transport
from .._comm.collectives import Recorded, Tagged
from .._comm.pairing import Entering
from .._comm import status as comm_status
from ..config import ShardingConfig
from .._groups.mesh import Mesh, control_group
from .._build.strategy import prefetch_depth, reshard_after_forward_table
from .._build.wrap import some_ranks_hint
from . import on_demand
from .protocols import ScheduledUnit
from .states import OrderState, RootPhase
from .._reduce.reduction import Reduction


def tags_suffice(mesh: Mesh, device: torch.device, every_strategy: bool = True) -> bool:
    """Every per-unit collective of ``mesh`` can be point to point with identity tags (gloo, CPU tensors; the
    status thread runs: it finds divergences), so tags check their pairing (``_comm/tagged.py``). Replica
    all-reduces are tagged too (``p2p._P2PAllReduce``) unless ``every_strategy`` is False
    (``pairing_check="strict"``: announcements for no_shard and hybrid, as before issue 30)."""
    if device.type != "cpu" or mesh.world_size == 1:
        return False
    groups = [g for g, n in ((mesh.shard_group, mesh.shard_size), (mesh.replicate_group, mesh.replicate_size)) if n > 1]
    if not every_strategy and (mesh.shard_size == 1 or mesh.replicate_size > 1):
        return False
    return all(native.point_to_point(g) for g in groups) and comm_status.publishing()


def pairing_mode(config: ShardingConfig, mesh: Optional[Mesh], device: torch.device) -> str:
    """How this root checks collective pairing (``ShardingConfig.pairing_check``): "tags" (gloo/CPU: no
    message), "hash" (the ledger hash in the step's control all-reduce: ``_comm/ledger.py``), "announce"
    (blocking announcements, ``_comm/pairing.py``) or "off"."""
    check = config.pairing_check
    if mesh is None or check == "off" or native.is_fake():
        return "off"      # torch's fake group: one process plays every rank, there is no peer to diverge from
    if tags_suffice(mesh, device, every_strategy=check == "auto"):
        return "tags"
    if check == "strict" or (device.type == "cpu" and _blocking_unit_groups(mesh)):
        return "announce"    # gloo/CPU without the status thread: a mismatched gloo collective would abort
    return "hash"            # NCCL, nccl_sim...: a mismatched collective hangs; the step's hash finds it


def _blocking_unit_groups(mesh: Mesh) -> bool:
    """Some group of ``mesh``'s unit collectives is gloo (``transport.BLOCKING``)."""
    groups = [g for g, n in ((mesh.shard_group, mesh.shard_size), (mesh.replicate_group, mesh.replicate_size)) if n > 1]
    return any(transport.of_group(g) is Transport.BLOCKING for g in groups)


class RootState:
    """Model-wide state; ``phase`` (a `RootPhase`) and ``order_state`` (an `OrderState`) move only here."""

    def __init__(self, config: ShardingConfig, mesh: Mesh, device: torch.device):
        self.config, self.mesh, self.device = config, mesh, device
        self.prefetch = prefetch_depth(config)   # units all-gathered ahead, per direction (0: none)
        self.units: list[ScheduledUnit] = []   # root first, parents before children (engine: `Unit`)
        self.reduction = Reduction(self)     # gradient reduction: no_sync window, reductions in flight, agreement
        self.phase = RootPhase.IDLE
        self.exec_order: list = []
        self.order_state = OrderState.RECORDING
        self._phase_before_full = RootPhase.IDLE
        # Filled once when the order freezes (``freeze_order``): the hot path only looks them up.
        self._forward_next: dict = {}       # unit -> units to prefetch after its unshard in forward
        self._backward_next: dict = {}      # unit -> units to prefetch at its pre-backward, nearest first
        self.unit_before_root = None        # the unit whose reduction the root's comes right after
        self._reshards = None               # reshard_table(), computed on first use and when the order freezes
        self._unit_index: dict = {}         # unit -> its index in ``units`` (the pairing code's unit number)
        self._hint = None                   # some_ranks_hint for divergence errors, computed at the first check
        self.join = None                    # join.JoinState: uneven inputs under torch's Join (fp.shard sets it)
        self.eval_join = None               # eval_join.EvalJoin while fp.join(model) is open
        self.tp_mesh = None                 # the tensor-parallel DeviceMesh of a DTensor model (fp.shard sets it)
        self.experts_mesh = None            # expert_parallel: the experts' ExpertMesh (``_experts/layout.py``)
        # some-ranks units gathered on demand (``on_demand.py``; fp.shard sets it for default-chosen encoders):
        # the units gathered for the coming backward, and those that ran on this rank in its forwards
        self.on_demand = False
        self._ready: set = set()
        self._ran: set = set()
        self._positional: Optional[list] = None   # the root forward's positional parameter names
        # Pairing check by identity tags (``_comm/tagged.py``) when every unit collective is point to point
        # (gloo, CPU, shard groups only), else by announcements (``_comm/pairing.py``).
        self.pairing = pairing_mode(config, mesh, device)
        self.tagged = self.pairing == "tags"
        self._root_number = tagged.new_root(self) if self.pairing in ("tags", "hash") else None

    @property
    def root_unit(self):
        return self.units[0]

    @property
    def some_ranks_units(self) -> list:
        """Units whose forward may run on some ranks only (``ShardingConfig.some_ranks_modules``)."""
        return [u for u in self.units if u.some_ranks]

    @property
    def in_backward(self) -> bool:
        return self.phase is RootPhase.BACKWARD

    @property
    def full_params_active(self) -> bool:
        return self.phase is RootPhase.FULL_PARAMS

    def enter_full_params(self) -> None:
        """-> FULL_PARAMS (fp.full_params); ``exit_full_params`` returns to the phase before."""
        self._phase_before_full, self.phase = self.phase, RootPhase.FULL_PARAMS

    def exit_full_params(self) -> None:
        self.phase = self._phase_before_full

    # ----------------------------------------------------------------- forward
    def before_unit_forward(self, unit, args, kwargs):
        if unit is self.root_unit:
            comm_status.begin_step()     # the step that deadline reports and trace files name
            if self.join is not None:
                self.join.before_forward(args, kwargs)
            if self.eval_join is not None:
                self.eval_join.before_forward(args, kwargs)
            if self.on_demand:
                self._decide_on_demand(args, kwargs)
            args, kwargs = self._cast_inputs(args, kwargs)
        elif unit.some_ranks and self.on_demand:
            if unit not in self._ready:      # gathered nowhere this step: a collective now would pair with nothing
                raise on_demand.not_gathered_error(unit)
            self._ran.add(unit)
        if self.order_state is OrderState.RECORDING and unit not in self.exec_order and not unit.some_ranks:
            self.exec_order.append(unit)   # some_ranks units: rank-dependent, so out of the order and prefetch
        return args, kwargs

    def _decide_on_demand(self, args, kwargs) -> None:
        """At the root's pre-forward (every rank, once per step): gather the some-ranks units this step only
        if some rank's inputs hold their modality (``on_demand.py``; one control message)."""
        if self._positional is None:
            self._positional = on_demand.positional_names(self.root_unit.module)
        local = on_demand.holds_modality(args, kwargs, self._positional)
        if self.mesh is not None and self.mesh.world_size > 1:
            timeout = pairing.comm.default_timeout_s(self.config.timeout_s)
            local = on_demand.any_rank_holds(local, timeout)
        else:
            local = True                     # one rank: the gather is local, nothing to decide
        if local:     # a second forward before backward may find them gathered already: on every rank, then
            self._ready |= set(self.some_ranks_units)

    def gate(self, entering: Entering, unit=None, prompt: bool = False, handle: int = 0):
        """The pairing of a per-unit collective about to be issued: a `Tagged` code (``_comm/tagged.py``) or an
        announcement (``_comm.pairing.Gate``; the collective is bound to it; ``prompt``: it is waited right
        away); None in a world of one rank. ``handle``: the handle's index in ``unit``."""
        mesh = self.mesh
        if mesh is None or mesh.world_size == 1 or self.pairing == "off":
            return None
        index = self.index_of(unit) if unit is not None else 0
        if self.pairing != "announce":
            kind = Tagged if self.tagged else Recorded
            return kind(tagged.code(int(entering), self._root_number, index, handle))
        return pairing.Gate(pairing.code(entering, index), self.units, control_group(), mesh.world_size,
                            self.config.timeout_s, prompt, self.divergence_hint())

    def divergence_hint(self) -> str:
        """The end of a divergence message (``_build/wrap.some_ranks_hint``), computed once: units never change."""
        if self._hint is None:
            self._hint = some_ranks_hint(self.root_unit.module, self.units)
        return self._hint

    def agree_next(self, entering: Entering, unit=None) -> None:
        """Where a rank's per-unit collectives may end early, every rank must be at the same point, else
        CollectiveError on every rank: a position of the tags (no message), or a blocking announcement."""
        if self.pairing == "off" or self.mesh is None or self.mesh.world_size == 1:
            return
        if self.pairing != "announce":
            tagged.mark(tagged.code(int(entering), self._root_number, 0, 0))
            return
        gate = self.gate(entering, unit, prompt=True)
        if gate is not None:
            gate.wait(pairing.describe(gate.code, self.units))

    def after_unshard_in_forward(self, unit) -> None:
        """Forward prefetch, in a real forward only: a recomputation in backward (activation checkpointing)
        would gather units whose backward is already done and keep them to the end of backward. The root's
        pre-forward, which every rank reaches once per step, also starts every ``some_ranks`` unit's gather."""
        if self.in_backward:
            return
        if unit is self.root_unit:
            for u in self.some_ranks_units:
                if not self.on_demand or u in self._ready:
                    u.unshard()
        if torch.is_grad_enabled():
            for nxt in self._forward_next.get(unit, ()):
                nxt.unshard()

    def after_unit_forward(self, unit, raised: bool = False) -> None:
        if unit is not self.root_unit:
            return
        if raised or not torch.is_grad_enabled():    # no backward will free them (local: no collective)
            for u in self.some_ranks_units:
                u.end_backward()
            self._ready, self._ran = set(), set()
        if self.order_state is OrderState.RECORDING:
            self.freeze_order(self.exec_order)
        if not raised and self.mesh is not None and self.mesh.shard_size > 1:
            self.agree_next(Entering.END_OF_FORWARD)   # a rank with more units' all-gathers left fails here

    def freeze_order(self, order: list) -> None:
        """RECORDING -> FROZEN with ``order`` (forward order of units): every prefetch target and the
        root-reduces-next unit, computed once (the planner's replay freezes a recorded order the same way)."""
        order = self.exec_order = list(order)
        self.order_state, depth = OrderState.FROZEN, self.prefetch
        self._forward_next = {u: order[i + 1:i + 1 + depth.forward] for i, u in enumerate(order)}
        self._backward_next = {u: [n for n in (self._backward_neighbour(u, k) for k in range(1, depth.backward + 1))
                                   if n is not None] for u in order}
        self.unit_before_root = order[1] if len(order) > 1 and order[0] is self.root_unit else None
        self._reshards = None               # recomputed with the order (``reshard_table``)

    def reshard_table(self) -> list[bool]:
        """Per unit (``units`` order): does it reshard after forward? ``strategy.reshard_after_forward_table``
        over the units' policies and, once frozen, the forward order."""
        if self._reshards is None or len(self._reshards) != len(self.units):
            frozen = self.order_state is OrderState.FROZEN
            order = [self.index_of(u) for u in self.exec_order] if frozen else None
            self._reshards = reshard_after_forward_table(self.config, [u.reshard_policy for u in self.units], order)
        return self._reshards

    def reshards_after_forward(self, unit) -> bool:
        """Whether ``unit`` frees its full parameters after its forward (its row of ``reshard_table``)."""
        return self.reshard_table()[self.index_of(unit)]

    def index_of(self, unit) -> int:
        """``unit``'s index in ``units`` (the same on every rank: the model's structure)."""
        if len(self._unit_index) != len(self.units):
            self._unit_index = {u: i for i, u in enumerate(self.units)}
        return self._unit_index[unit]

    def _cast_inputs(self, args, kwargs):
        mp = self.config.mixed_precision
        if mp is None or mp.param_dtype is None or not mp.cast_forward_inputs:
            return args, kwargs

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != mp.param_dtype:
                return x.to(mp.param_dtype)
            return x
        return tree_map(cast, args), tree_map(cast, kwargs)

    # ---------------------------------------------------------------- backward
    def on_backward_hook(self) -> None:
        """IDLE -> BACKWARD at the first engine hook of a backward, queuing the end-of-backward callback."""
        if self.phase is not RootPhase.BACKWARD:
            self.enter_backward()
            Variable._execution_engine.queue_callback(self._end_of_backward)
            if self.on_demand:
                self._release_unused()

    def _release_unused(self) -> None:
        """At the start of a backward (no forward of this step can follow; recomputation re-runs only what
        ran): on demand, free the gathered some-ranks units that did not run on this rank. Not earlier: another
        forward before this backward must find them gathered on every rank, or its gather would not pair."""
        for u in [u for u in self._ready if u not in self._ran]:
            u.reshard()
            self._ready.discard(u)

    def enter_backward(self) -> None:
        """-> BACKWARD (the planner's replay calls it at its first pre-backward, as the engine's hooks do)."""
        self.phase = RootPhase.BACKWARD

    def exit_backward(self) -> None:
        """BACKWARD -> IDLE (end of backward; the replay's too)."""
        self.phase = RootPhase.IDLE

    def _backward_neighbour(self, unit, k: int):
        """The unit k places after ``unit`` in backward order: reverse forward order, except that the root's
        backward starts first (the output layers after the last unit, e.g. a tied LM head) and ends last."""
        order = self.exec_order
        if not order or unit not in order:
            return None
        if unit is self.root_unit:
            return order[-k] if k < len(order) else None
        i = order.index(unit) - k
        return order[i] if i >= 0 else None

    def prefetch_backward(self, unit) -> None:
        for nxt in self._backward_next.get(unit, ()):
            if not nxt.in_backward:
                nxt.unshard()

    def _end_of_backward(self) -> None:
        """BACKWARD -> IDLE: finish reductions, reshard every unit, agree on unused parameters (the mask
        all-reduce is issued first so that it overlaps the last reduction)."""
        reduction = self.reduction
        if self.mesh.shard_size > 1 or not reduction.no_sync:    # this backward's plan had collectives
            self.agree_next(Entering.END_OF_BACKWARD)
        reduction.start_agreement()
        reduction.verify_pairing()       # the ledger hash: before a gradient can be waited for or used
        try:
            reduction.finish_pending()
        finally:
            for unit in self.units:
                unit.end_backward()
            self._ready, self._ran = set(), set()
            self.exit_backward()
        reduction.finish_agreement()

    def reset(self) -> None:
        """Abandon the current step (fp.reset): any phase -> IDLE, every unit IDLE and sharded, in-flight
        collectives finished, unreduced gradients dropped. Raises the first CollectiveError after cleaning up.
        After a divergence the pairing checks are re-aligned first (every rank calls fp.reset then)."""
        if tagged.diverged():
            tagged.drain(control_group(), pairing.comm.default_timeout_s(self.config.timeout_s))
        if pairing.diverged():
            pairing.realign(self.units, control_group(), self.mesh.world_size, self.config.timeout_s)
        with pairing.abandoning():
            self._abandon()

    def _abandon(self) -> None:
        error = self.reduction.abandon()
        for unit in self.units:
            for h in unit.handles:
                try:
                    h.abandon_step()
                except Exception as e:  # noqa: BLE001 - every handle is cleaned; the first error is re-raised
                    error = error or e
            unit.end_backward()
        self._ready, self._ran = set(), set()
        self.phase = RootPhase.IDLE
        if error is not None:
            raise error
