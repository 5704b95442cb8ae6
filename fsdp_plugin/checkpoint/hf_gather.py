"""Fallback for :func:`hf.save_pretrained` when ranks do not share a filesystem: rank 0 receives every
writer rank's piece, one parameter at a time (point-to-point), and writes it. Peak extra memory on rank 0:
the largest single piece (plus a cast chunk)."""
from __future__ import annotations

import json

import torch

from . import _comm


def gather_write(writer, shards, buffers, write_tensor) -> None:
    """Route every piece to rank 0 (point-to-point, with the deadline); ``write_tensor(name, tensor, start)`` there."""
    rank, world, dev = _comm.rank(), _comm.world_size(), _comm._device()
    mine = [[sh.start, sh.end] if sh.writer and sh.end > sh.start else None for sh in shards]
    table = _comm.gather_bytes(json.dumps(mine).encode(), step="gathering the piece table")
    table = [json.loads(t) for t in table] if rank == 0 else None
    for i, sh in enumerate(shards):
        if rank != 0:
            if mine[i] is not None:
                _comm.send(sh.param.detach().reshape(-1).to(dev).contiguous(), 0, f"sending {sh.fqn!r} to rank 0")
            continue
        for r in range(world):
            rng = table[r][i]
            if rng is None:
                continue
            if r == 0:
                write_tensor(sh.fqn, sh.param, rng[0])
            else:
                buf = torch.empty(rng[1] - rng[0], dtype=sh.dtype, device=dev)
                _comm.recv(buf, r, f"receiving {sh.fqn!r} from rank {r}")
                write_tensor(sh.fqn, buf, rng[0])
    if rank == 0:
        for name, buf in buffers:
            write_tensor(name, buf, 0)
