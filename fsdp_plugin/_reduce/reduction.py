"""The gradient reduction of one sharded model, owned here: the no_sync window, the reductions in flight, and the
unused-parameter agreement that ends a reducing backward.

``RootState.reduction`` is the one instance; `Unit` hands it each handle's gradient (``grad_ready``), the root's
end-of-backward callback finishes it (``start_agreement``, ``finish_pending``, ``finish_agreement``), fp.reset
abandons it (``abandon``). The handle keeps only its own collective in flight (``FlatParamHandle.start_reduce`` /
``finish_reduce``) and its usage marks (``_reduce/usage.py``).

States (``ReduceWindow``: what backwards do with gradients; ``ReduceState``: what is in flight)::

    window  SYNC --fp.no_sync() enter--> NO_SYNC --exit--> the window before
    state   IDLE --first reduction issued--> IN_FLIGHT --end of backward: mask all-reduce issued--> AGREEING
            AGREEING --every reduction finished, masks applied--> IDLE        any --fp.reset--> IDLE
            (a reducing backward without gradients goes IDLE --> AGREEING directly)
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from .._comm.pairing import Entering
from .._schedule.states import ReduceState, ReduceWindow
from .usage import UsageAgreement

# Reductions left in flight: each holds a unit's full unsharded gradient until it completes, and the next
# unit's backward compute is enough to hide one reduce-scatter, so only the newest stays pending.
_MAX_PENDING_REDUCES = 1


class Reduction:
    """``window`` and ``state`` move only here."""

    def __init__(self, root):
        self.root = root
        self.window = ReduceWindow.SYNC
        self.state = ReduceState.IDLE
        self._pending: deque = deque()        # handles whose reduction was issued and not finished, oldest first
        # handles whose reduction has a second stage still in flight: hybrid's cross-replica all-reduce (issued
        # when its reduce-scatter finished; each holds a 1/S chunk) and a tagged ring all-reduce's phase 2
        # (no_shard above two ranks). It overlaps the rest of backward and is waited at its end (``finish_pending``)
        self._replicating: deque = deque()
        self._advanced = 0     # leading entries of ``_replicating`` already advanced (``advance_reduce``)
        self._agreement: Optional[UsageAgreement] = None   # the mask all-reduce issued and not yet finished

    @property
    def no_sync(self) -> bool:
        return self.window is ReduceWindow.NO_SYNC

    def enter_no_sync(self) -> ReduceWindow:
        """-> NO_SYNC (fp.no_sync); returns the window to restore with ``restore_window``."""
        previous, self.window = self.window, ReduceWindow.NO_SYNC
        return previous

    def restore_window(self, previous: ReduceWindow) -> None:
        self.window = previous

    # ---------------------------------------------------------------- backward
    def grad_ready(self, h, unit) -> None:
        """Handle ``h`` of ``unit`` has its unsharded gradient (post-accumulate hook): accumulate it in the no_sync
        window, else issue its reduction (announced for the pairing check when it communicates). A
        ``some_ranks`` unit's gradient is always kept: every rank reduces it at the end of backward
        (``UsageAgreement.finish``), since only some ranks reach this hook."""
        if self.no_sync or unit.some_ranks:
            h.accumulate_without_sync()
            h.usage.close_backward(reducing=False)
            return
        grad = h.take_unsharded_grad()
        if grad is None:
            return
        h.usage.close_backward(reducing=True)
        gate = self.root.gate(Entering.REDUCTION, unit, handle=unit.handles.index(h)) if h.reduce_communicates else None
        self.enqueue(h, grad, unit, gate)

    def enqueue(self, handle, grad: Optional[torch.Tensor], unit=None, gate=None) -> None:
        """Issue ``handle``'s reduction (with its pairing ``gate``, if any) and finish older ones beyond the
        in-flight limit (the planner's replay calls this too, with its stand-in handles and no gate)."""
        # second stages issued at an earlier gradient: one unit of backward later, their own sums are done and
        # their phase 2 posted here, so it overlaps the rest of backward (tagged all-reduces; else nothing)
        while self._advanced < len(self._replicating):
            self._replicating[self._advanced].advance_reduce()
            self._advanced += 1
        if gate is None:
            handle.start_reduce(grad)
        else:
            handle.start_reduce(grad, gate)
        self._pending.append(handle)
        self.state = ReduceState.IN_FLIGHT
        # The root's gradient is assembled last (embedding backward + the flat leaf's gradient: its peak of the
        # step); a reduction still in flight then would hold its unit's full gradient and the reduction's buffers.
        limit = 0 if unit is not None and unit is self.root.unit_before_root else _MAX_PENDING_REDUCES
        while len(self._pending) > limit:
            self._advance(self._pending.popleft())

    def _advance(self, handle) -> None:
        if handle.finish_reduce(final=False):
            self._replicating.append(handle)

    def start_agreement(self) -> None:
        """End of a backward: issue the unused-parameter mask all-reduce (reducing backwards only) before
        waiting for the last reductions, so that the two overlap."""
        if not self.no_sync:
            self._agreement = UsageAgreement(self.root)
            self.state = ReduceState.AGREEING

    def verify_pairing(self) -> None:
        """Under the ledger hash (``RootState.pairing == "hash"``): wait for the mask all-reduce that carries
        it and raise the divergence on every rank, before the last reductions are waited for (one may be
        stuck) and before any gradient reaches an optimizer. Elsewhere nothing (the mask is waited later)."""
        if self._agreement is not None:
            self._agreement.verify()

    def finish_pending(self) -> None:
        """End of backward: finish the reduce-scatters (issuing the last all-reduces), then every all-reduce."""
        while self._pending:
            self._advance(self._pending.popleft())
        for h in list(self._replicating)[self._advanced:]:   # every phase 2 posted before the first is waited
            h.advance_reduce()
        self._advanced = 0
        while self._replicating:
            self._replicating.popleft().finish_reduce()

    def finish_agreement(self) -> None:
        """-> IDLE: apply the agreed masks (``p.grad = None`` for slots no rank used; late no_sync reductions).
        Not reached when a reduction raised: the mask all-reduce stays in flight for ``abandon``."""
        agreement, self._agreement = self._agreement, None
        self.state = ReduceState.IDLE
        if agreement is not None:
            agreement.finish()
        offload = getattr(self.root, "offload", None)
        if offload is not None:      # cpu_offload: the one host wait for this backward's gradient copies (late
            offload.finish_backward()    # no_sync reductions included), after the mask all-reduce it overlapped

    def abandon(self) -> Optional[Exception]:
        """fp.reset: any state -> IDLE, unfinished reductions forgotten (the handles wait for their own work),
        the mask all-reduce waited for. Returns its error instead of raising (the caller cleans up first)."""
        self._pending.clear()
        self._replicating.clear()
        self._advanced = 0
        offload = getattr(self.root, "offload", None)
        if offload is not None:      # cpu_offload: gradient copies already issued land before anything is freed
            offload.finish_backward()
        agreement, self._agreement = self._agreement, None
        self.state = ReduceState.IDLE
        if agreement is not None:
            try:
                agreement.drain()
            except Exception as e:  # noqa: BLE001 - the handles are still cleaned; the first error is re-raised
                return e
        return None
