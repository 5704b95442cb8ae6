"""Ranks on ONE GPU: ``world`` processes over gloo with CUDA tensors on device 0 (NCCL refuses two ranks on one
GPU; gloo does not), or on CPU with ``--dry``. Rank 0's result comes back as JSON, so a section's worker returns a
dict of plain values."""
from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _trampoline(rank, world, store, out, dry, fn, args):
    dev = device(dry)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        got = fn(rank, world, dev, *args)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(got, f)
    finally:
        import fsdp_plugin as fp
        fp.shutdown()        # ends the process group too


def spawn(fn, world: int, dry: bool, *args) -> dict:
    """``fn(rank, world, device, *args)`` on ``world`` spawned ranks; rank 0's return value."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_trampoline, args=(world, os.path.join(tmp, "store"), out, dry, fn, args), nprocs=world)
        with open(out) as f:
            return json.load(f)


def peak_mib(dev: torch.device):
    return round(torch.cuda.max_memory_allocated(dev) / 2**20, 1) if dev.type == "cuda" else None


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def emit(row: dict) -> bool:
    print("GPU_CHECK_JSON " + json.dumps(row), flush=True)
    return bool(row.get("ok"))


def error_text(e: BaseException) -> str:
    """The last line of an exception's text (a spawned rank's traceback ends with its error)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:300]
