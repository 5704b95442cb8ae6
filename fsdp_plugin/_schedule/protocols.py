"""The typed contract between units and the root (`Unit` ↔ `RootState`), and what the planner's stand-ins implement.

`RootState` decides the schedule (order, prefetch, reductions in flight, phase) and calls units and handles only
through `ScheduledUnit` and `ReducingHandle`; the planner's replay (``planner/_replay.py``: ``_SimUnit``,
``_SimHandle``) implements these two to run the engine's own schedule over byte accounting. `Unit` calls the
root only through `UnitRoot`. ``runtime_checkable`` so that tests can check the stand-ins against them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .._reduce.reduction import Reduction


@runtime_checkable
class ScheduledUnit(Protocol):
    """What the root's schedule reads of a unit."""

    name: str
    reshard_policy: bool     # the config's rule for this unit (``UnitPolicy``), input of ``reshard_table``
    some_ranks: bool         # may run on some ranks only: gathered at the root's pre-forward, reduced at the end

    @property
    def in_backward(self) -> bool:
        """The unit's backward has started (its parameters are, or are being, unsharded for it)."""

    def unshard(self) -> None:
        """Start all-gathering the unit's handles (no-op for those already unsharded or in flight)."""


@runtime_checkable
class ReducingHandle(Protocol):
    """What the reduction queue (``Reduction.enqueue``) calls on a handle."""

    def start_reduce(self, grad: torch.Tensor) -> None:
        """Issue the handle's gradient reduction (asynchronous); engine handles also take the pairing gate
        (``FlatParamHandle.start_reduce(grad, gate)``), stand-ins never get one."""

    def finish_reduce(self, final: bool = True) -> bool:
        """Wait for it and accumulate the reduced shard into the parameters' ``.grad``; with ``final=False`` a
        second stage (hybrid's cross-node all-reduce) may be left in flight: True then, and the queue calls
        ``finish_reduce()`` again at the end of backward."""

    def advance_reduce(self) -> None:
        """Take a second stage left in flight as far as it goes without waiting for a peer's later stage (a
        tagged all-reduce: its part summed, phase 2 posted); a no-op for stand-ins."""


@runtime_checkable
class UnitRoot(Protocol):
    """What a `Unit`'s hooks call on the root (``RootState``)."""

    @property
    def in_backward(self) -> bool: ...

    reduction: "Reduction"      # the model's gradient reduction (``_reduce/reduction.py``): ``grad_ready``

    def before_unit_forward(self, unit, args, kwargs) -> tuple: ...

    def after_unshard_in_forward(self, unit) -> None: ...

    def after_unit_forward(self, unit, raised: bool = False) -> None: ...

    def reshards_after_forward(self, unit) -> bool: ...

    def on_backward_hook(self) -> None: ...

    def prefetch_backward(self, unit) -> None: ...

    def agree_next(self, entering, unit=None) -> None: ...

    def gate(self, entering, unit=None, prompt: bool = False, handle: int = 0): ...
