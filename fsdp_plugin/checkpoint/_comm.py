"""Small control-plane collectives for checkpointing (JSON bytes and flags, never tensors of state).

All functions work without an initialized process group (world of one). Payloads are UTF-8 JSON
strings moved as uint8 tensors, so saving needs no pickle either (unlike ``all_gather_object``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .fsio import byte_view


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def _device(group=None) -> torch.device:
    """Device for control tensors: CUDA for an NCCL group (default: the default group), else CPU."""
    if active() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        dist.barrier()


def all_true(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank."""
    if not active():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` on every rank."""
    if not active():
        return data or b""
    dev = _device()
    n = torch.tensor([len(data or b"")], dtype=torch.int64, device=dev)
    dist.broadcast(n, src)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        dist.broadcast(buf, src)
    return _to_bytes(buf)


def all_gather_bytes(data: bytes, group=None) -> list[bytes]:
    """Every rank's ``data``, indexed by rank (``group``: all ranks, default the default group)."""
    if not active():
        return [data]
    dev, world = _device(group), world_size()
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    cap = max(int(s.item()) for s in sizes)
    mine = torch.zeros(max(cap, 1), dtype=torch.uint8, device=dev)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(outs, mine, group=group)
    return [_to_bytes(o[: int(s.item())]) for o, s in zip(outs, sizes)]


def _to_bytes(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.cpu().contiguous()))


def gather_bytes(data: bytes, dst: int = 0, group=None) -> list[bytes] | None:
    """Every rank's ``data`` on rank ``dst`` (indexed by rank); None on the other ranks."""
    if not active():
        return [data]
    dev, world, me = _device(group), world_size(), rank()
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)] if me == dst else None
    dist.gather(n, sizes, dst=dst, group=group)
    cap = torch.tensor([max(int(s.item()) for s in sizes) if me == dst else 0], dtype=torch.int64, device=dev)
    dist.broadcast(cap, dst, group=group)
    mine = torch.zeros(max(int(cap.item()), 1), dtype=torch.uint8, device=dev)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.zeros_like(mine) for _ in range(world)] if me == dst else None
    dist.gather(mine, outs, dst=dst, group=group)
    if me != dst:
        return None
    return [_to_bytes(o[: int(s.item())]) for o, s in zip(outs, sizes)]


def raise_if_any_failed(err: BaseException | None, group=None) -> None:
    """Collective: if any rank passes an exception, every rank raises (its own, or a copy naming the rank).

    Also a barrier. The copy keeps the original class when it is one of :mod:`.errors`.
    """
    import json

    from . import errors

    msg = b"" if err is None else json.dumps({"cls": type(err).__name__, "msg": str(err)}).encode()
    msgs = all_gather_bytes(msg, group)
    if err is not None:
        raise err
    for r, m in enumerate(msgs):
        if m:
            info = json.loads(m)
            cls = getattr(errors, info["cls"], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.CheckpointError)):
                cls = errors.CheckpointError
            raise cls(f"rank {r} failed: {info['cls']}: {info['msg']}")
