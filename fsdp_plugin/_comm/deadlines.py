"""Deadlines that never block the host: a monitor thread polls the collectives a rank waits for on the device.

On NCCL, ``work.wait(timeout=...)`` blocks the calling thread until the GPU has finished everything queued before
the collective (torch ≥ 2.6: with a timeout, ProcessGroupNCCL polls on the host), so a deadline passed to every
wait costs a host–GPU round trip per unit and the CPU can never run ahead. Instead, on every transport whose wait
does not already block the host (``transport.STREAM``: NCCL, ``nccl_sim``, any non-gloo backend),
``collectives.wait`` hands the collective to this module *before* its plain ``work.wait()`` (so a wait that does
block, e.g. NCCL's barrier or ``TORCH_NCCL_BLOCKING_WAIT=1``, has the deadline too):

- ``watch`` appends a `Handle` with its deadline, counted from the collective's issue (as torch's own watchdog
  counts it), on a monotonic clock. Microseconds; no device call. After the plain wait, on CUDA, the handle
  trades the work for an event recorded on the current stream (``Handle.after_wait``): every work type (torch's,
  quantized wrappers) is then polled the same way, and the handle keeps no collective's buffers alive.
- A daemon thread polls every entry every ``POLL_S`` (``Handle.done``: an event query or ``is_completed()``,
  never blocking), retiring completed ones (``on_retire``: the collective is marked finished for the late-rank
  report) and failing at the first entry past its deadline, wherever it sits in the queue. It builds the
  `CollectiveError` that a timed wait would have raised (``collectives._collective_error``: the late ranks named
  from the rendezvous store, no collective), stores it, marks the process failed and aborts the stuck group, which
  releases a training thread blocked in C (a ``.item()``, the allocator, a full launch queue).
- The training thread raises the stored error at its next engine entry (``check``: every collective issue and
  wait, the optimizer step's pre-hook). On CUDA the host may already have queued kernels behind the stuck
  collective (waits do not block), which run on garbage once the group is aborted: a deadline is fatal to the
  process's training state, as with torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``. The engine therefore refuses
  further steps and saves after a failure (``_build/guards.refuse_after_failure``), naming the last checkpoint
  saved before it; nothing computed after the failure reaches a checkpoint.

torch's own watchdog stays the backstop: the engine's groups are created with a process-group timeout longer
than the deadline (``_groups/mesh.py``), so ours fires first and names the late rank.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

POLL_S = 0.05           # how often the monitor looks at the oldest pending collective


class Handle:
    """What the monitor polls for one collective: the work until its plain wait, then (on CUDA) an event recorded
    on the current stream right after it, which completes when the collective has, whatever object issued it,
    and holds none of its buffers. The work itself is unwrapped to torch's (``.work`` chains: our `_Tracked`
    records, quantized collectives' ``_Then``), so every work type is polled the same way."""

    __slots__ = ("work", "event")

    def __init__(self, work):
        while hasattr(work, "work"):
            work = work.work
        self.work, self.event = work, None

    def after_wait(self, device) -> None:
        """The plain wait was issued: on CUDA, poll an event behind it instead of the work (and drop the work)."""
        if device is not None and device.type == "cuda":
            import torch
            event = torch.cuda.Event()
            event.record()
            self.event, self.work = event, None

    def done(self) -> bool:
        """Completed (never blocks); a failed work raises here (the watchdog's story, told now)."""
        if self.event is not None:
            return self.event.query()
        return self.work.is_completed()


class _Entry:
    __slots__ = ("handle", "op", "what", "timeout_s", "deadline", "group", "on_retire")

    def __init__(self, handle: Handle, op, what: str, timeout_s: float, group, on_retire):
        self.handle, self.op, self.what, self.timeout_s, self.group = handle, op, what, timeout_s, group
        self.on_retire = on_retire
        # counted from the issue, on the monotonic clock (a wall-clock step must not fire or hide a deadline)
        age = max(time.time() - op.t_issue, 0.0) if op is not None else 0.0
        self.deadline = time.monotonic() - age + timeout_s


class Monitor:
    """The queue of watched collectives and the thread that polls it (one per process, started lazily)."""

    def __init__(self, make_error: Callable, abort: Callable):
        self._make_error, self._abort = make_error, abort
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.watched = 0          # collectives handed over (tests count them)

    def watch(self, work, op, what: str, timeout_s: float, group=None, on_retire=None) -> Handle:
        """Watch ``work`` (or a `Handle`) until it completes, at most ``timeout_s`` after its issue; returns the
        handle (``after_wait`` it once the plain wait is issued). ``on_retire(op)``: called when it completes."""
        if self.error is not None:
            raise self.error
        handle = work if isinstance(work, Handle) else Handle(work)
        with self._lock:
            self._pending.append(_Entry(handle, op, what, timeout_s, group, on_retire))
            self.watched += 1
            if self._thread is None:      # under the lock: async-checkpoint threads wait too
                self._stop = False
                self._thread = threading.Thread(target=self._run, name="fsdp_plugin-deadlines", daemon=True)
                self._thread.start()
        return handle

    def stop(self) -> None:
        """fp.shutdown / destroy: the thread ends, nothing stays watched, a stored error is forgotten (the
        process groups it named are gone; a new ``init_process_group`` starts clean)."""
        with self._lock:
            self._stop, thread, self._thread = True, self._thread, None
            self._pending.clear()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout=2 * POLL_S + 1)
        self._wake.clear()
        self.error = None

    def check(self) -> None:
        """On the training thread: raise the deadline error the monitor found, if any."""
        if self.error is not None:
            raise self.error

    def pending(self) -> int:
        return len(self._pending)

    def poll(self, now: Optional[float] = None) -> None:
        """Retire every completed collective; fail at the first one past its deadline (the thread calls this).
        Every entry is looked at: one with a long deadline (a checkpoint gather) must not hide an expired one
        behind it. ``now``: a ``time.monotonic()`` reading."""
        now = time.monotonic() if now is None else now
        with self._lock:
            entries = list(self._pending)
        retired = []
        for entry in entries:
            try:
                done = entry.handle.done()
            except Exception as e:  # noqa: BLE001 - the watchdog marked it failed: the same story, now
                self._fail(entry, e)
                return
            if done:
                retired.append(entry)
            elif now >= entry.deadline:
                self._fail(entry, None)
                return
        if retired:
            with self._lock:
                gone = set(map(id, retired))
                self._pending = deque(e for e in self._pending if id(e) not in gone)
            for entry in retired:
                if entry.on_retire is not None:
                    entry.on_retire(entry.op)

    def _fail(self, entry: _Entry, cause) -> None:
        if self.error is not None:
            return
        try:
            self.error = self._make_error(entry.what, entry.timeout_s, cause, entry.op)
        except Exception as e:  # noqa: BLE001 - reading the store failed: the deadline is still the story
            self.error = e
        finally:
            try:
                self._abort(entry.group)    # always: a thread blocked in the group must be released
            finally:
                with self._lock:
                    self._pending.clear()

    def _run(self) -> None:
        while self.error is None and not self._stop:
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the monitor must not die silently: the error is the report
                if self.error is None:
                    self.error = e
                return
            self._wake.wait(POLL_S)

    def wait_done(self, handle: Handle, poll_s: float = 0.001) -> None:
        """A deliberate host wait (a control value the host reads at once, outside a step): poll ``handle``
        until it completes or the monitor fails it, never with ``wait(timeout=)``."""
        while not handle.done():
            self.check()
            time.sleep(poll_s)
        self.check()


def abort_group(name: Optional[str]) -> None:
    """Release every thread blocked on the group named ``name`` (None or "p2p": the default group, which carries
    point-to-point sends): its communicator is lost. (The monitor keeps group names, not groups: holding a group
    would keep it alive past fp.shutdown.) A name no live group has any more aborts nothing."""
    from .. import _compat
    pg = _compat.group_named(name) if name not in (None, "p2p") else _compat.default_group()
    if pg is None:
        return
    try:
        _compat.abort_group(pg)
    except RuntimeError:     # a backend whose abort refuses (gloo): its own timeout, past our deadline, ends it
        pass
