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
        self.after: list[Callable[[], None]] = []  #: run once the pending save is published (see :meth:`defer`)

    def wait(self) -> None:
        """Wait for the pending save, if any, and forget it; re-raise its failure. Then run what :meth:`defer`
        queued; when the save failed, that is dropped (the checkpoints it would remove are the newest ones left)."""
        handle, self.handle = self.handle, None
        after, self.after = self.after, []
        if handle is not None:
            handle.wait()
        for fn in after:
            fn()

    def defer(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the pending save is published: now when none is pending, else at the next :meth:`wait`
        (the next save, a load, teardown). Keep-last-k removal goes through here, so the previous checkpoint is
        deleted only after the one replacing it is complete, also when that one is written in the background."""
        if self.handle is None:
            fn()
        else:
            self.after.append(fn)

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
