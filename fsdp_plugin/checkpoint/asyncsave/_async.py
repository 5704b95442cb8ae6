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
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import _comm
from ..._groups.shutdown import run_before_shutdown

_lock = threading.Lock()
_pending: "AsyncSave | None" = None
#: Staging buffers of each model's last finished save, reused by its next: model -> {(dtype, numel): [t]}.
#: An entry goes away with its model (weak key), with :func:`release_staging_buffers` and with ``fp.shutdown``.
_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_generation = 0           # bumped by release_staging_buffers: a save pending across it does not re-pool
_group_cache: tuple = ()  # (default group object, checkpoint group)
_copy_streams: dict = {}  # CUDA device -> the side stream of staging copies


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
    from fsdp_plugin._comm.collectives import default_timeout_s

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=default_timeout_s(None)))
    _group_cache = (world, group)
    return group


def release_staging_buffers(model=None) -> int:
    """Free the host staging buffers kept for asynchronous saves; return how many bytes were released.

    ``async_save=True`` keeps one host copy of each model's local state between saves, so the next save
    copies into memory that is already mapped (fresh memory page-faults on first touch, ~5x slower than the
    copy itself). The copy goes away with the model (garbage collection), with ``fp.shutdown()``, or here:
    ``model`` = that model's buffers, None = every model's. A save still pending keeps its buffers until it
    finishes, then frees them instead of keeping them.
    """
    global _generation
    with _lock:
        _generation += 1
        pools = [_pools.pop(model, {})] if model is not None else list(_pools.values())
        if model is None:
            _pools.clear()
    return sum(t.numel() * t.element_size() for pool in pools for ts in pool.values() for t in ts)


def shutdown() -> None:
    """``fp.shutdown``: wait for the pending save, then free every staging buffer."""
    wait_pending()
    release_staging_buffers()


class Stager:
    """Host copies of tensors (pinned for CUDA tensors), reusing the same model's previous staging buffers.

    ``deferred=False``: every copy is made when the tensor is staged (before ``save_checkpoint`` returns).
    CPU tensors are copied at once; CUDA tensors are copied on a side stream that first waits for the caller's
    stream, and :meth:`finish` makes the caller's stream wait for those copies (later kernels, which may
    overwrite the sources, run after them), so the call does not wait for the device: the checkpoint
    thread waits for the copies' event before writing.
    ``deferred=True``: large state (parameters, optimizer state) is copied by :meth:`copy_deferred` on the
    checkpoint thread, fenced by every optimizer's ``step()``; small tensors (buffers, ``extra``) still now.
    """

    def __init__(self, model, deferred: bool = False):
        with _lock:
            self._free = _pools.pop(model, {})
            self._generation = _generation
        self._owner = weakref.ref(model)
        self.deferred = deferred
        self.used: list[torch.Tensor] = []
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._streams: dict = {}  # device -> the caller's stream (deferred copies are ordered on it)
        self._side: dict = {}     # device -> side stream of this save's copies at the call
        self._events: list = []   # recorded after the copies at the call, waited for by the checkpoint thread
        self._reading: list = []  # device sources the side streams read: held until ``finish`` orders their
        #                           allocating (caller's) stream after the copies (no ``record_stream``)

    def __call__(self, t: torch.Tensor, large: bool = False) -> torch.Tensor:
        """A 1-D host buffer that holds (or, deferred and ``large``, will hold) ``t``'s values now."""
        t = t.detach()
        key = (t.dtype, t.numel())
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(t.numel(), dtype=t.dtype, pin_memory=t.is_cuda)
        self.used.append(buf)
        if t.is_cuda and t.device not in self._streams:
            self._streams[t.device] = torch.cuda.current_stream(t.device)
        if self.deferred and large:
            self._later.append((t, buf))
        elif t.is_cuda:
            self._copy_on_side_stream(t, buf)
        else:
            buf.copy_(t.reshape(-1))
        return buf

    def _copy_on_side_stream(self, t: torch.Tensor, buf: torch.Tensor) -> None:
        side = self._side.get(t.device)
        if side is None:
            if t.device not in _copy_streams:
                _copy_streams[t.device] = torch.cuda.Stream(t.device)
            side = self._side[t.device] = _copy_streams[t.device]
        src = t.reshape(-1)  # may itself be a copy queued on the caller's stream: wait after it
        side.wait_stream(self._streams[t.device])
        with torch.cuda.stream(side):
            buf.copy_(src, non_blocking=True)
        self._reading.append(src)   # its memory goes back to the allocator only after ``finish``'s stream wait

    def finish(self) -> None:
        """Caller side, before returning: drop unused old buffers; order later device work after the copies."""
        self._free = {}
        for device, side in self._side.items():
            event = torch.cuda.Event()
            event.record(side)
            self._streams[device].wait_event(event)  # no host wait: the caller's next kernels queue behind
            self._events.append(event)
        self._reading.clear()     # the caller's stream, whose pool they return to, is ordered after the copies

    def copy_deferred(self) -> None:
        """Checkpoint thread: make the deferred copies (on the caller's device streams) and wait for every
        device copy of this save (deferred or not) before anything is written."""
        for src, buf in self._later:
            if src.is_cuda:
                with torch.cuda.stream(self._streams[src.device]):
                    buf.copy_(src.reshape(-1), non_blocking=True)
            else:
                buf.copy_(src.reshape(-1))
        for event in self._events:
            event.synchronize()
        if self._later:
            for stream in self._streams.values():
                stream.synchronize()
        self._later = []

    def release(self) -> None:
        """Keep this save's buffers for the model's next save (unless released meanwhile or the model is gone)."""
        pool: dict = {}
        for buf in self.used:
            pool.setdefault((buf.dtype, buf.numel()), []).append(buf)
        self.used = []
        owner = self._owner()
        with _lock:
            if owner is not None and self._generation == _generation:
                _pools[owner] = pool


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
run_before_shutdown(shutdown)  # fp.shutdown waits for the pending save and frees the staging buffers first
