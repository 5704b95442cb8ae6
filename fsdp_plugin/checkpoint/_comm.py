"""Small control-plane collectives for checkpointing (JSON bytes and flags, never tensors of state).

All functions work without an initialized process group (world of one). Payloads are UTF-8 JSON
strings moved as uint8 tensors, so saving needs no pickle either (unlike ``all_gather_object``).
Every call goes through :mod:`fsdp_plugin._comm.collectives` with a deadline: the model's
``ShardingConfig(timeout_s=...)`` inside :func:`deadline_of` (the public entry points use
:func:`uses_model_deadline`), else ``FSDP_PLUGIN_TIMEOUT_S`` (480 s). A rank that dies or stalls becomes
a :class:`~fsdp_plugin.CollectiveError` naming the operation on the others.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import torch
import torch.distributed as dist

from .._comm import collectives as comm

_TIMEOUT: contextvars.ContextVar = contextvars.ContextVar("fsdp_plugin_checkpoint_timeout", default=None)
_OP: contextvars.ContextVar = contextvars.ContextVar("fsdp_plugin_checkpoint_op", default="checkpoint")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def _device(group=None) -> torch.device:
    """Device for control tensors: the process group's device (see ``_collectives.device``); CPU for a
    non-NCCL side group such as the async-save gloo group."""
    if group is not None and active() and dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return comm.device()


def deadline_of(model, op: str):
    """Inside: collectives wait at most the model's ``timeout_s`` and errors name ``op``."""
    from .._flat.layout import sharding_info

    return deadline(sharding_info(model).timeout_s if model is not None else None, op)


@contextlib.contextmanager
def deadline(timeout_s, op: str):
    """Inside: collectives wait at most ``timeout_s`` (None: ``FSDP_PLUGIN_TIMEOUT_S``) and errors name ``op``."""
    t1 = _TIMEOUT.set(timeout_s)
    t2 = _OP.set(op)
    try:
        yield
    finally:
        _TIMEOUT.reset(t1)
        _OP.reset(t2)


def uses_model_deadline(fn):
    """Decorator for a public collective entry point with a ``model`` argument (see :func:`deadline_of`)."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        model = sig.bind_partial(*args, **kwargs).arguments.get("model")
        with deadline_of(model, fn.__name__):
            return fn(*args, **kwargs)
    return wrapper


def _what(step: str) -> str:
    return f"{_OP.get()}: {step}"


def _timeout():
    return _TIMEOUT.get()


def barrier(step: str = "barrier") -> None:
    if active():
        comm.barrier(_what(step), _timeout())


def all_true(flag: bool, step: str = "agreeing on a flag") -> bool:
    """True iff ``flag`` is true on every rank."""
    if not active():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    comm.all_reduce(t, None, op=dist.ReduceOp.MIN, kind="control", what=_what(step), timeout_s=_timeout())
    return bool(t.item())


def broadcast_bytes(data: bytes | None, src: int = 0, step: str = "broadcasting metadata") -> bytes:
    """Rank ``src``'s ``data`` on every rank."""
    return comm.broadcast_bytes(data, src, _what(step), _timeout())


def all_gather_bytes(data: bytes, step: str = "exchanging metadata", group=None) -> list[bytes]:
    """Every rank's ``data``, indexed by rank (``group``: all ranks, default the default group)."""
    if not active():
        return [data]
    return comm.all_gather_bytes(data, group, _what(step), _timeout(), _device(group))


def gather_bytes(data: bytes, dst: int = 0, step: str = "gathering metadata", group=None) -> list[bytes] | None:
    """Every rank's ``data`` on rank ``dst`` (indexed by rank); None on the other ranks."""
    if not active():
        return [data]
    return comm.gather_bytes(data, dst, group, _what(step), _timeout(), _device(group))


def send(t: torch.Tensor, dst: int, step: str) -> None:
    """Point-to-point ``t`` to rank ``dst`` (which calls :func:`recv`), with the deadline."""
    comm.send(t, dst, what=_what(step), timeout_s=_timeout())


def recv(t: torch.Tensor, src: int, step: str) -> None:
    """Fill ``t`` from rank ``src``'s :func:`send`, with the deadline."""
    comm.recv(t, src, what=_what(step), timeout_s=_timeout())


def raise_if_any_failed(err: BaseException | None, step: str = "checking every rank succeeded",
                        group=None) -> None:
    """Collective: if any rank passes an exception, every rank raises (its own, or a copy naming the rank).

    Also a barrier. The copy keeps the original class when it is one of :mod:`.errors`. A
    :class:`CollectiveError` is raised at once: its peers are gone or out of step, so no agreement is possible.
    """
    import json

    from . import errors

    if isinstance(err, comm.CollectiveError):
        raise err
    msg = b"" if err is None else json.dumps({"cls": type(err).__name__, "msg": str(err)}).encode()
    msgs = [msg]
    if active():  # one all-gather of the lengths (0: success); the messages only when a rank failed
        what, dev = _what(step), _device(group)
        lens = comm.all_gather_lengths(len(msg), group, what, _timeout(), dev)
        msgs = comm.all_gather_bytes(msg, group, what, _timeout(), dev, lengths=lens) if any(lens) else []
    if err is not None:
        raise err
    for r, m in enumerate(msgs):
        if m:
            info = json.loads(m)
            cls = getattr(errors, info["cls"], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
                cls = errors.CheckpointError
            raise cls(f"rank {r} failed: {info['cls']}: {info['msg']}")
