"""Clean end of a distributed run: ``fp.shutdown()`` joins the process group's threads while Python is alive.

Why (torch 2.13, gloo; measured with a core dump, see docs/INTERNALS.md "Shutdown"): a gloo collective
runs on one of the process group's C++ worker threads, which keeps the finished work object (and the
tensors in it) until it loops back for the next item. When the script has already dropped its Python
reference to such a tensor, the worker's release is the last one and must take the GIL to free the
tensor's Python object. If the main thread has meanwhile reached interpreter finalization, CPython 3.11
ends the worker with ``pthread_exit``; the forced unwind crosses a ``noexcept`` C++ destructor
(``~AsyncWork``), so libstdc++ calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, about one run in a few on a loaded machine. ``dist.destroy_process_group()`` does not help: gloo's
``shutdown()`` is a no-op, and the C++ process group (its worker threads) lives on while anything -- a
sharded model, DDP, a cached sub-group -- still references it, i.e. until finalization.

So :func:`shutdown` (1) waits for every rank and every pending collective (a barrier with a deadline),
(2) waits, with the GIL released, until no other thread of the process is runnable (the workers have
finished releasing their work; bounded at 2 s), (3) destroys the groups, drops this package's references
to them (the meshes of sharded models, the cached hybrid sub-groups) and collects garbage: where nothing
else holds a group, its C++ destructor (run with the GIL released by torch) joins the threads here. Where
something does (``import torch._dynamo``, which torch.optim's first step does, pins the default group;
so does a DDP model), the threads stay, idle. ``os._exit`` is not used: it would skip the script's own
exit handlers and buffered output.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import weakref
from typing import Callable, Optional

import torch.distributed as dist

from .. import _compat
from .._comm import collectives as comm
from .._comm import status as comm_status
from . import mesh as _mesh


# Work of the layers above (checkpoint) that must end before the groups go; they register here, so that the
# engine imports none of them.
_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def run_before_shutdown(hook: Callable[[], None]) -> None:
    """Have ``fp.shutdown`` call ``hook()`` (once per registration, in order) before it destroys the groups."""
    if hook not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append(hook)


def shutdown(timeout_s: Optional[float] = None) -> bool:
    """End the distributed run cleanly; call it on every rank as the script's last collective.

    Waits (at most ``timeout_s`` seconds; default ``FSDP_PLUGIN_TIMEOUT_S`` or 600) until every rank
    arrives and every collective issued before completes, then destroys all process groups so that their
    threads are joined now rather than during interpreter exit (which can abort the process with
    "terminate called without an active exception", see :mod:`fsdp_plugin._groups.shutdown`). A no-op without an
    initialized process group (then it only drops this package's references). Returns True when every group
    was destroyed and its threads joined; False when an object outside fsdp_plugin still references a group
    (``import torch._dynamo``, done by torch.optim's first step, does; so do DDP models): its threads then
    stay, but idle -- shutdown waits until no thread of the process is runnable (at most 2 s) first.
    Raises :class:`CollectiveError` if another rank does not arrive in time (it probably failed); the
    groups are then left alone, since their threads may still be inside the failed collective.
    """
    for hook in _BEFORE_SHUTDOWN:
        hook()  # e.g. a background checkpoint save: its collectives need the groups destroyed below
    if dist.is_available() and dist.is_initialized():
        comm.barrier("fp.shutdown (waiting for every rank to finish)", timeout_s)
        _settle()
    return destroy()


def destroy() -> bool:
    """Destroy every process group now (no barrier) and drop fsdp_plugin's references to them.

    Also useful after a plain ``dist.destroy_process_group()``: the groups this package still referenced
    go away here. Returns True when nothing else references them, i.e. their C++ threads were joined.
    """
    comm.MONITOR.stop()  # nothing is watched past the groups (a failure stays recorded: ``_comm/failure.py``)
    if comm.FAILED:
        # a timed-out collective may still occupy a gloo thread: joining it would block until gloo's own
        # timeout, so the groups are left to the process exit
        return False
    comm_status.stop()   # its thread reads the default group's store
    refs = _group_refs()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _mesh.release_groups()
    gc.collect()
    alive = sum(r() is not None for r in refs)
    if alive:
        # still referenced elsewhere (importing torch._dynamo -- done by torch.optim's first step -- keeps the
        # default group alive, so do DDP models and DeviceMeshes): its threads live on, idle after _settle()
        _settle()
    return alive == 0


def _settle(max_s: float = 2.0, quiet_samples: int = 3, interval_s: float = 0.005) -> None:
    """Let gloo's worker threads finish releasing completed work while Python is alive: wait, with the GIL
    released, until no other thread of this process is runnable in ``quiet_samples`` samples in a row (a
    worker in that window is runnable, or blocked on the GIL, which each sleep hands over), at most ``max_s``."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):  # not Linux: a fixed grace period
        time.sleep(0.05)
        return
    me, quiet, end = str(threading.get_native_id()), 0, time.monotonic() + max_s
    while quiet < quiet_samples and time.monotonic() < end:
        time.sleep(interval_s)
        quiet = 0 if _any_runnable(tasks, me) else quiet + 1


def _any_runnable(tasks: str, me: str) -> bool:
    for tid in os.listdir(tasks):
        if tid == me:
            continue
        try:
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "R":
            return True
    return False


def _group_refs() -> list:
    """Weak references to every live process group, to check that they are really gone afterwards."""
    groups = list(_mesh.referenced_groups())
    if dist.is_available():
        groups += _compat.live_groups()
    refs, seen = [], set()
    for g in groups:
        if id(g) in seen:
            continue
        seen.add(id(g))
        try:
            refs.append(weakref.ref(g))
        except TypeError:  # a group type without weak references: cannot be checked
            pass
    return refs


_REGISTERED = False


def register_at_exit() -> None:
    """Run :func:`_at_exit` when the interpreter exits (once per process; called when a mesh is built)."""
    global _REGISTERED
    if not _REGISTERED:
        _REGISTERED = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    """Safety net for scripts that end without :func:`shutdown`: atexit handlers run before finalization,
    so destroying the groups here still joins their threads in time. No barrier (ranks may be exiting for
    different reasons), and nothing after an uncaught exception (pending work may wait for peers)."""
    if getattr(sys, "last_value", None) is not None:
        return
    try:
        _settle()
        destroy()
    except Exception:  # noqa: BLE001 - never turn a clean exit into a failure
        pass
