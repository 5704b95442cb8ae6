"""Rank 0 receiving parameter pieces (point-to-point, one parameter at a time), for :func:`hf.save_pretrained`:

* :func:`gather_write`: the fallback when ranks do not share a filesystem: rank 0 receives every writer
  rank's piece and writes it. Peak extra memory on rank 0: the largest single piece (plus a cast chunk).
* :func:`gather_full`: a whole parameter on rank 0, for tensors transformers converts while saving
  (e.g. fused experts split back per expert): peak extra memory is that parameter.
"""
from __future__ import annotations

import json

import torch

from .. import _comm


def piece_table(shards) -> list | None:
    """On rank 0: ``table[r][i]`` = ``[start, end)`` of ``shards[i]`` that rank ``r`` writes, or None. Collective."""
    mine = [[sh.start, sh.end] if sh.writer and sh.end > sh.start else None for sh in shards]
    table = _comm.gather_bytes(json.dumps(mine).encode(), step="gathering the piece table")
    return [json.loads(t) for t in table] if _comm.rank() == 0 else None


def _send_mine(sh) -> None:
    if sh.writer and sh.end > sh.start:
        _comm.send(sh.param.detach().reshape(-1).to(_comm._device()).contiguous(), 0,
                   f"sending {sh.fqn!r} to rank 0")


def gather_write(writer, shards, buffers, write_tensor) -> None:
    """Route every piece to rank 0 (point-to-point, with the deadline); ``write_tensor(name, tensor, start)`` there."""
    rank, dev = _comm.rank(), _comm._device()
    table = piece_table(shards)
    for i, sh in enumerate(shards):
        if rank != 0:
            _send_mine(sh)
            continue
        for r, row in enumerate(table):
            rng = row[i]
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


def gather_full(sh, i: int, table) -> torch.Tensor | None:
    """The full value of ``sh`` (shape ``sh.shape``) on rank 0, None elsewhere. Collective over writer ranks."""
    if _comm.rank() != 0:
        _send_mine(sh)
        return None
    full = torch.empty(sh.shape.numel(), dtype=sh.dtype, device=_comm._device())
    for r, row in enumerate(table):
        rng = row[i]
        if rng is None:
            continue
        if r == 0:
            full[rng[0]:rng[1]].copy_(sh.param.detach().reshape(-1))
        else:
            _comm.recv(full[rng[0]:rng[1]], r, f"receiving {sh.fqn!r} from rank {r}")
    return full.view(sh.shape)
