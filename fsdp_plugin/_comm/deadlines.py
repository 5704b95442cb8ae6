"""Deadlines that never block the host: a monitor thread polls the collectives a rank waits for on the device.

On NCCL, ``work.wait(timeout=...)`` blocks the calling thread until the GPU has finished everything queued before
the collective (torch ≥ 2.6: with a timeout, ProcessGroupNCCL polls on the host), so a deadline passed to every
wait costs a host–GPU round trip per unit and the CPU can never run ahead. Instead, on every backend whose wait
does not already block the host (anything but gloo), ``collectives.wait`` calls the plain ``work.wait()`` (it only
orders the current stream after the collective) and hands the work to this module:

- ``watch`` appends it to a queue with its deadline, counted from the collective's issue (as torch's own
  watchdog counts it). Microseconds; no device call.
- A daemon thread polls the oldest entries every ``POLL_S`` with ``work.is_completed()`` (an event query: never
  blocks), retiring them in order. When the oldest is past its deadline it builds the `CollectiveError` that a
  timed wait would have raised (``collectives._collective_error``: the late ranks named from the rendezvous store,
  no collective), stores it, marks the process failed and aborts the stuck group, which releases a training
  thread blocked in C (a ``.item()``, the allocator, a full launch queue) with garbage in the buffers.
- The training thread raises the stored error at its next engine entry (``check``: every collective issue and
  wait, the optimizer step's pre-hook), before any buffer of an aborted collective is used: nothing is
  half-applied.

torch's own watchdog stays the backstop: the engine's groups are created with a process-group timeout longer
than the deadline (``_groups/mesh.py``), so ours fires first and names the late rank.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

POLL_S = 0.05           # how often the monitor looks at the oldest pending collective


class _Entry:
    __slots__ = ("work", "op", "what", "timeout_s", "deadline", "group")

    def __init__(self, work, op, what: str, timeout_s: float, group):
        self.work, self.op, self.what, self.timeout_s, self.group = work, op, what, timeout_s, group
        start = op.t_issue if op is not None else time.time()
        self.deadline = start + timeout_s


class Monitor:
    """The queue of watched collectives and the thread that polls it (one per process, started lazily)."""

    def __init__(self, make_error: Callable, abort: Callable):
        self._make_error, self._abort = make_error, abort
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.watched = 0          # collectives handed over (a counted fact for tests)

    def watch(self, work, op, what: str, timeout_s: float, group=None) -> None:
        if self.error is not None:
            raise self.error
        with self._lock:
            self._pending.append(_Entry(work, op, what, timeout_s, group))
            self.watched += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fsdp_plugin-deadlines", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """On the training thread: raise the deadline error the monitor found, if any."""
        if self.error is not None:
            raise self.error

    def pending(self) -> int:
        return len(self._pending)

    def poll(self, now: Optional[float] = None) -> None:
        """Retire completed collectives oldest first; at an expired one, fail (the thread calls this)."""
        now = time.time() if now is None else now
        while True:
            with self._lock:
                if not self._pending:
                    return
                entry = self._pending[0]
            try:
                done = entry.work.is_completed()
            except Exception as e:  # noqa: BLE001 - the watchdog marked it failed: the same story, now
                self._fail(entry, e)
                return
            if done:
                with self._lock:
                    if self._pending and self._pending[0] is entry:
                        self._pending.popleft()
                continue
            if now >= entry.deadline:
                self._fail(entry, None)
            return

    def _fail(self, entry: _Entry, cause) -> None:
        if self.error is not None:
            return
        self.error = self._make_error(entry.what, entry.timeout_s, cause, entry.op)
        try:
            self._abort(entry.group)
        finally:
            with self._lock:
                self._pending.clear()

    def _run(self) -> None:
        while self.error is None:
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the monitor must not die silently: the error is the report
                if self.error is None:
                    self.error = e
                return
            self._wake.wait(POLL_S)

    def wait_done(self, work, poll_s: float = 0.001) -> None:
        """A deliberate host wait (a control value the host reads at once, outside a step): poll ``work`` until
        it completes or the monitor fails it, never with ``wait(timeout=)``."""
        while not work.is_completed():
            self.check()
            time.sleep(poll_s)
        self.check()


class _Done:
    """A work with nothing left to do (torch's fake group: its FakeWork never reports completion)."""

    @staticmethod
    def is_completed() -> bool:
        return True


DONE = _Done()


def abort_group(name: Optional[str]) -> None:
    """Release every thread blocked on the group named ``name`` (None: the default group): its communicator is
    lost. (The monitor keeps group names, not groups: holding a group would keep it alive past fp.shutdown.)"""
    import torch.distributed as dist
    c10d = dist.distributed_c10d
    pg = next((g for g, n in getattr(c10d._world, "pg_names", {}).items() if n == name), None) if name else None
    try:
        (pg if pg is not None else c10d._get_default_group()).abort()
    except Exception:  # noqa: BLE001 - a backend without abort(): torch's watchdog (a longer timeout) is the backstop
        pass
