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
from ..format.boxes import box_runs


def piece_table(shards) -> list | None:
    """On rank 0: ``table[r][i]`` = what rank ``r`` writes of ``shards[i]``: ``[start, end]`` (a plain piece),
    ``[start, end, offsets, sizes]`` (a tensor-parallel box of the global tensor), or None. Collective."""
    mine = [None if not (sh.writer and sh.end > sh.start) else [sh.start, sh.end] if sh.box is None
            else [sh.start, sh.end, list(sh.box[0]), list(sh.box[1])] for sh in shards]
    table = _comm.gather_bytes(json.dumps(mine).encode(), step="gathering the piece table")
    return [json.loads(t) for t in table] if _comm.rank() == 0 else None


def entry_runs(entry: list, shape) -> list[tuple[int, int]]:
    """A :func:`piece_table` entry's ``(global_start, n)`` runs of the flattened full tensor, in storage order."""
    if len(entry) == 4:
        return box_runs(tuple(shape), entry[2], entry[3])
    return [(entry[0], entry[1] - entry[0])]


def write_runs(write_tensor, name: str, flat: torch.Tensor, runs) -> None:
    """``write_tensor(name, part, global_start)`` for each run of a piece stored as ``flat`` (storage order)."""
    pos = 0
    for a, n in runs:
        write_tensor(name, flat[pos:pos + n], a)
        pos += n


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
                buf = sh.param.detach().reshape(-1)
            else:
                buf = torch.empty(rng[1] - rng[0], dtype=sh.dtype, device=dev)
                _comm.recv(buf, r, f"receiving {sh.fqn!r} from rank {r}")
            write_runs(write_tensor, sh.fqn, buf, entry_runs(rng, sh.shape))
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
        if r != 0 and len(rng) == 2:     # a plain piece lands in place
            _comm.recv(full[rng[0]:rng[1]], r, f"receiving {sh.fqn!r} from rank {r}")
            continue
        buf = sh.param.detach().reshape(-1)
        if r != 0:
            buf = torch.empty(rng[1] - rng[0], dtype=sh.dtype, device=full.device)
            _comm.recv(buf, r, f"receiving {sh.fqn!r} from rank {r}")
        write_runs(lambda _, part, a: full[a:a + part.numel()].copy_(part), sh.fqn, buf, entry_runs(rng, sh.shape))
    return full.view(sh.shape)
