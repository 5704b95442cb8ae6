"""One integration object's asynchronous checkpoint (Lightning strategy, Accelerator, Trainer): one tracker.

``fp.save_checkpoint(async_save=...)`` returns an ``fp.AsyncSave`` handle and writes in the background. The
integrations keep at most one such save in flight per object: :meth:`PendingSave.start` waits for the
previous one before starting the next (so its failure surfaces there, and nothing rotates a directory still
being written), their loads call :meth:`PendingSave.wait` first, and their teardown waits too (the
background save's collectives need the process groups that teardown destroys).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PendingSave:
    """The pending ``fp.AsyncSave`` of one integration object, if any, and how many were started."""

    def __init__(self) -> None:
        self.handle: Any = None  #: the pending ``fp.AsyncSave`` (None: nothing in flight)
        self.started = 0  #: asynchronous saves started through :meth:`start`

    def wait(self) -> None:
        """Wait for the pending save, if any, and forget it; re-raise its failure."""
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.wait()

    def start(self, save: Callable[[], Any]) -> Any:
        """Wait for the previous save, then run ``save()`` (a synchronous save returns None); keep its handle."""
        self.wait()
        handle = save()
        if handle is not None:
            self.handle = handle
            self.started += 1
        return handle


def of(obj: Any) -> PendingSave:
    """``obj``'s tracker (created on first use, stored as ``obj._fp_pending_save``)."""
    tracker = getattr(obj, "_fp_pending_save", None)
    if tracker is None:
        tracker = PendingSave()
        obj._fp_pending_save = tracker
    return tracker
