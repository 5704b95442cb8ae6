"""State shared by all units of one sharded model: execution order, prefetch, pending reductions, and
the end-of-backward callback that waits for reductions and reshards whatever is still unsharded."""
from __future__ import annotations

from collections import deque

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from .._comm import collectives as comm
from .._comm import status as comm_status
from ..config import ShardingConfig
from ..errors import CollectiveError
from .._groups.mesh import Mesh
from .states import OrderState, RootPhase
from .._reduce.usage import UsageAgreement

# Reductions left in flight: each holds a unit's full unsharded gradient until it completes, and the next
# unit's backward compute is enough to hide one reduce-scatter, so only the newest stays pending.
_MAX_PENDING_REDUCES = 1


class RootState:
    """Model-wide state; ``phase`` (a `RootPhase`) and ``order_state`` (an `OrderState`) move only here."""

    def __init__(self, config: ShardingConfig, mesh: Mesh, device: torch.device):
        self.config, self.mesh, self.device = config, mesh, device
        self.units: list = []               # root first, parents before children
        self.no_sync = False
        self.phase = RootPhase.IDLE
        self.exec_order: list = []
        self.order_state = OrderState.RECORDING
        self._pending: deque = deque()
        self._phase_before_full = RootPhase.IDLE
        # Filled once when the order freezes (``freeze_order``): the hot path only looks them up.
        self._forward_next: dict = {}       # unit -> units to prefetch after its unshard in forward
        self._backward_next: dict = {}      # unit -> units to prefetch at its pre-backward, nearest first
        self._unit_before_root = None       # the unit whose reduction the root's comes right after
        self._kept_last = None              # the last unit in forward order, kept unsharded until its backward
        self._agreement = None              # a usage-mask all-reduce issued and not yet finished
        self.join = None                    # join.JoinState: uneven inputs under torch's Join (fp.shard sets it)

    @property
    def root_unit(self):
        return self.units[0]

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
            args, kwargs = self._cast_inputs(args, kwargs)
        if self.order_state is OrderState.RECORDING:
            self._verify_same_unit_everywhere(unit)
            if unit not in self.exec_order:
                self.exec_order.append(unit)
        return args, kwargs

    def _verify_same_unit_everywhere(self, unit) -> None:
        """First forward only: all ranks must enter the same unit, else their collectives would mismatch
        (a hang, or silently wrong data when sizes happen to agree). One tiny all-gather per unit, once."""
        if self.mesh.world_size == 1:
            return
        mine = torch.tensor([self.units.index(unit)], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.mesh.world_size, dtype=torch.int64, device=self.device)
        work = comm.all_gather(everyone, mine, None, async_op=True, kind="control")
        comm.wait(work, f"execution-order check before unit {unit.name!r}", unit.handles[0].timeout_s
                  if unit.handles else None)
        seen = everyone.tolist()
        if len(set(seen)) > 1:
            names = ", ".join(f"rank {r} runs {self.units[i].name!r}" for r, i in enumerate(seen))
            raise CollectiveError(f"ranks diverged in their first forward ({names}): every rank must run the same "
                                  "units in the same order (no rank-dependent branches around sharded modules)")

    @property
    def prefetch_depth(self) -> int:
        """Units all-gathered ahead of use. limit_all_gathers bounds unsharded units to the one in use
        plus one in flight (besides the root); without it two are prefetched (more overlap, more memory)."""
        return 1 if self.config.limit_all_gathers else 2

    def after_unshard_in_forward(self, unit) -> None:
        if self.config.forward_prefetch and self.order_state is OrderState.FROZEN and torch.is_grad_enabled():
            for nxt in self._forward_next.get(unit, ()):
                nxt.unshard()

    def after_unit_forward(self, unit) -> None:
        if unit is self.root_unit and self.order_state is OrderState.RECORDING:
            self.freeze_order(self.exec_order)

    def freeze_order(self, order: list) -> None:
        """RECORDING -> FROZEN with ``order`` (forward order of units): every prefetch target and the
        root-reduces-next unit, computed once (the planner's replay freezes a recorded order the same way)."""
        order = self.exec_order = list(order)
        self.order_state, depth = OrderState.FROZEN, self.prefetch_depth
        self._forward_next = {u: order[i + 1:i + 1 + depth] for i, u in enumerate(order)}
        self._backward_next = {u: [n for n in (self._backward_neighbour(u, k) for k in range(1, depth + 1))
                                   if n is not None] for u in order}
        self._unit_before_root = order[1] if len(order) > 1 and order[0] is self.root_unit else None
        default_policy = self.config.reshard_after_forward is None
        self._kept_last = order[-1] if default_policy and order and order[-1] is not self.root_unit else None

    def reshards_after_forward(self, unit) -> bool:
        """Whether ``unit`` frees its full parameters after its forward: its policy (``unit.reshard_after_forward``),
        except the last unit of the frozen forward order under the strategy's default policy. Backward needs that
        one first (the root's pre-backward prefetches it), so resharding it would only all-gather it again at once
        (torchtitan keeps its last block the same way); an explicit ``reshard_after_forward`` is obeyed."""
        return unit.reshard_after_forward and unit is not self._kept_last

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
            self.phase = RootPhase.BACKWARD
            Variable._execution_engine.queue_callback(self._end_of_backward)

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
        if self.config.backward_prefetch:
            for nxt in self._backward_next.get(unit, ()):
                if not nxt.in_backward:
                    nxt.unshard()

    def enqueue_reduce(self, handle, grad: torch.Tensor, unit=None) -> None:
        handle.start_reduce(grad)
        self._pending.append(handle)
        # The root's gradient is assembled last (embedding backward + the flat leaf's gradient: its peak of the
        # step); a reduction still in flight then would hold its unit's full gradient and the reduction's buffers.
        limit = 0 if unit is not None and unit is self._unit_before_root else _MAX_PENDING_REDUCES
        while len(self._pending) > limit:
            self._pending.popleft().finish_reduce()

    def _end_of_backward(self) -> None:
        """BACKWARD -> IDLE: finish reductions, reshard every unit, agree on unused parameters (the mask
        all-reduce is issued first so that it overlaps the last reduction)."""
        agreement = self._agreement = None if self.no_sync else UsageAgreement(self)
        try:
            while self._pending:
                self._pending.popleft().finish_reduce()
        finally:
            for unit in self.units:
                unit.end_backward()
            self.phase = RootPhase.IDLE
        # A reduction that raised leaves the mask all-reduce in flight: fp.reset waits for it (``reset``).
        self._agreement = None
        if agreement is not None:
            agreement.finish()

    def reset(self) -> None:
        """Abandon the current step (fp.reset): any phase -> IDLE, every unit IDLE and sharded, in-flight
        collectives finished, unreduced gradients dropped. Raises the first CollectiveError after cleaning up."""
        error = None
        self._pending.clear()
        agreement, self._agreement = self._agreement, None
        if agreement is not None:
            try:
                agreement.drain()
            except Exception as e:  # noqa: BLE001 - the handles are still cleaned; the first error is re-raised
                error = e
        for unit in self.units:
            for h in unit.handles:
                try:
                    h.abandon_step()
                except Exception as e:  # noqa: BLE001 - every handle is cleaned; the first error is re-raised
                    error = error or e
            unit.end_backward()
        self.phase = RootPhase.IDLE
        if error is not None:
            raise error
