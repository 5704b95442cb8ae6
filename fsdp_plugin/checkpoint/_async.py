"""Background half of ``save_checkpoint(..., async_save=True)``: host staging, the writer thread, the handle.

Design (why it cannot deadlock): the calling thread does every collective that touches the default process
group (uid broadcast, snapshot agreement) before returning. The background thread then writes, checksums and
publishes; its own collectives (record gather, failure agreement) run on a *separate* gloo group created
once, collectively, by the first asynchronous save. Two groups never share a gloo context, so the training
thread's collectives and the checkpoint thread's can run at the same time in any interleaving.

Invariants: at most one save is pending per process (a new save, sync or async, and a load first wait for
it); staged copies are taken before the call returns, so the files hold the values at the call; the writer
thread is non-daemon, so a normally exiting process finishes (and publishes) pending saves before it exits,
while a killed one leaves only a ``.tmp-`` directory that the next save removes.
"""
from __future__ import annotations

import contextvars
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _comm

_lock = threading.Lock()
_pending: "AsyncSave | None" = None
_pool: dict = {}          # staging buffers of the last finished save, reused by the next: (dtype, numel) -> [t]
_group_cache: tuple = ()  # (default group object, checkpoint group)


class AsyncSave:
    """Handle of a pending asynchronous checkpoint save (returned by ``save_checkpoint(async_save=True)``)."""

    def __init__(self, path: str):
        self.path = path
        self._error: BaseException | None = None
        self._observed = False
        self._thread: threading.Thread | None = None
        self._snapshotted = threading.Event()  # set once the host copies hold the call's values

    def snapshot_done(self) -> bool:
        """True once the host snapshot is complete (always, unless ``async_save="deferred"``)."""
        return self._snapshotted.is_set()

    def done(self) -> bool:
        """True once the background write finished (published, or failed: :meth:`wait` raises then)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is published; re-raise the background failure, if any.

        ``timeout`` (seconds): raise :class:`TimeoutError` if still pending after it (the save continues).
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout}s")
        self._observed = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"AsyncSave({self.path!r}, {state})"


def wait_pending() -> None:
    """Wait for this process's pending save; re-raise its failure if nobody observed it yet."""
    global _pending
    with _lock:
        h, _pending = _pending, None
    if h is None:
        return
    if h._observed:  # its error (if any) was already raised once
        h._thread.join()
    else:
        h.wait()


def checkpoint_group():
    """The gloo group for background checkpoint collectives (collective on first use); None at world 1."""
    global _group_cache
    if not _comm.active():
        return None
    world = dist.group.WORLD
    if _group_cache and _group_cache[0] is world:
        return _group_cache[1]
    from fsdp_plugin._collectives import default_timeout_s

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=default_timeout_s(None)))
    _group_cache = (world, group)
    return group


class Stager:
    """Host copies of tensors (pinned for device tensors), reusing the previous save's buffers.

    ``deferred=False``: every copy is made when the tensor is staged (before ``save_checkpoint`` returns).
    ``deferred=True``: large state (parameters, optimizer state) is copied by :meth:`copy_deferred` on the
    checkpoint thread, fenced by every optimizer's ``step()``; small tensors (buffers, ``extra``) still now.
    """

    def __init__(self, deferred: bool = False):
        global _pool
        with _lock:
            self._free, _pool = _pool, {}
        self.deferred = deferred
        self.used: list[torch.Tensor] = []
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._streams: dict = {}  # device -> the caller's stream (device copies are ordered on it)

    def __call__(self, t: torch.Tensor, large: bool = False) -> torch.Tensor:
        """A 1-D host buffer that holds (or, deferred and ``large``, will hold) ``t``'s values now."""
        t = t.detach()
        key = (t.dtype, t.numel())
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        if t.is_cuda and t.device not in self._streams:
            self._streams[t.device] = torch.cuda.current_stream(t.device)
        self.used.append(buf)
        if self.deferred and large:
            self._later.append((t, buf))
        else:
            buf.copy_(t.reshape(-1), non_blocking=t.is_cuda)
        return buf

    def finish(self) -> None:
        """Caller side, before returning: drop unused old buffers; in copy mode wait for device copies."""
        self._free = {}
        if not self.deferred:
            self._sync()

    def copy_deferred(self) -> None:
        """Checkpoint thread: make the deferred copies (on the caller's device streams) and wait for them."""
        for src, buf in self._later:
            if src.is_cuda:
                with torch.cuda.stream(self._streams[src.device]):
                    buf.copy_(src.reshape(-1), non_blocking=True)
            else:
                buf.copy_(src.reshape(-1))
        self._later = []
        self._sync()

    def _sync(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def release(self) -> None:
        """Give this save's buffers to the next one."""
        global _pool
        pool: dict = {}
        for buf in self.used:
            pool.setdefault((buf.dtype, buf.numel()), []).append(buf)
        with _lock:
            _pool = pool
        self.used = []


def _fence(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: a deferred snapshot must be taken before parameters change."""
    h = _pending
    if h is not None:
        h._snapshotted.wait()


_fence_handle = None


def _install_fence() -> None:
    global _fence_handle
    if _fence_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _fence_handle = register_optimizer_step_pre_hook(_fence)


def start(path: str, work, stager: Stager) -> AsyncSave:
    """On the checkpoint thread: the deferred copies, then ``work(err)`` (the collective write + publish, which
    makes every rank raise when ``err`` or its own failure is set on any rank); return the handle."""
    global _pending
    handle = AsyncSave(path)
    if stager.deferred:
        _install_fence()
    else:
        handle._snapshotted.set()

    def run():
        try:
            err = None
            try:
                stager.copy_deferred()
            except Exception as e:  # noqa: BLE001 - every rank learns it in work's agreement
                err = e
            finally:
                handle._snapshotted.set()
            work(err)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            handle._error = e
        finally:
            stager.release()

    ctx = contextvars.copy_context()  # the caller's deadline (timeout_s) and operation name for its collectives
    handle._thread = threading.Thread(target=ctx.run, args=(run,), name="fsdp_plugin-checkpoint", daemon=False)
    with _lock:
        _pending = handle
    handle._thread.start()
    return handle


def _warn_unobserved_at_exit() -> None:
    h = _pending
    if h is not None and h.done() and h._error is not None and not h._observed:
        print(f"fsdp_plugin: asynchronous checkpoint save to {h.path} failed: {h._error!r}", file=sys.stderr)


import atexit  # noqa: E402 - registered after the definitions it uses

atexit.register(_warn_unobserved_at_exit)
