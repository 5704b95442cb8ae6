"""The owner exchange of fp.optim.Muon: split matrices travel to their owner for Newton–Schulz and back.

Per flat handle, one all-to-all there and one back, inside the handle's shard group (a hybrid_shard replica
does the same inside its own group). Every rank sends its bf16 piece of each split matrix to the matrix's
owner (``FlatParamHandle.owners``); the owner lays the pieces at their element ranges, runs ``ns`` on the
full matrix and sends each holder its rows of the result. Pieces are whole rows of the flattened matrix, so
"the rows of the result" is the same element range ``[lo, hi)`` that was sent. bf16 loses nothing:
Newton–Schulz casts its input to bf16 first and returns bf16. Every rank of the group must call
:func:`orthogonalize_split` for the same handles, with the same entries, in the same order.
"""
from __future__ import annotations

from typing import Callable

import torch

from .._comm import collectives as comm


def orthogonalize_split(handle, entries: list, ns: Callable) -> list:
    """``entries``: ``[(slot_index, update_piece, ns_args)]`` for split 2-D slots of ``handle`` in slot order.

    Returns this rank's bf16 rows of ``ns(full_update, *ns_args)`` per entry, shaped like its update piece.
    """
    n, me, dev = handle.mesh.shard_size, handle.mesh.shard_rank, handle.device
    pieces = [[handle.piece_of(handle.slots[i], j) for j in range(n)] for i, _, _ in entries]
    owners = [handle.owners[i] for i, _, _ in entries]
    there = [[] for _ in range(n)]
    for (_, upd, _), owner, pc in zip(entries, owners, pieces):
        if pc[me][1] > pc[me][0]:
            there[owner].append(upd.reshape(-1).to(dev, torch.bfloat16))
    got_splits = [sum(pc[j][1] - pc[j][0] for pc, o in zip(pieces, owners) if o == me) for j in range(n)]
    got = exchange(handle, there, got_splits, "there")
    back = [[] for _ in range(n)]
    pos = [sum(got_splits[:j]) for j in range(n)]
    for (i, _, args), owner, pc in zip(entries, owners, pieces):
        if owner != me:
            continue
        slot = handle.slots[i]
        full = torch.empty(slot.numel, dtype=torch.bfloat16, device=dev)
        for j, (lo, hi) in enumerate(pc):
            full[lo:hi] = got[pos[j]:pos[j] + hi - lo]
            pos[j] += hi - lo
        result = ns(full.view(slot.shape), *args).reshape(-1)
        for j, (lo, hi) in enumerate(pc):
            if hi > lo:
                back[j].append(result[lo:hi])
    mine = exchange(handle, back, [sum(t.numel() for t in there[j]) for j in range(n)], "back")
    return _split_by_entry(mine, entries, owners, pieces, me, n)


def exchange(handle, parts: list, out_splits: list, leg: str, dtype: torch.dtype = torch.bfloat16,
                who: str = "Muon") -> torch.Tensor:
    """Concatenate ``parts[j]`` (destined to group rank j, 1-D tensors of ``dtype``) and exchange inside the
    handle's shard group; the received elements, by source. Shared with the generic owner step."""
    dev = handle.device
    in_splits = [sum(t.numel() for t in ts) for ts in parts]
    flat = [t for ts in parts for t in ts]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=dev)
    out = torch.empty(sum(out_splits), dtype=dtype, device=dev)
    if handle.mesh.shard_size == 1:
        return inp
    comm.all_to_all(out, inp, out_splits, in_splits, handle.mesh.shard_group,
                    what=f"{who} exchange ({leg}) of unit {handle.label!r}", timeout_s=handle.timeout_s)
    return out


def _split_by_entry(mine: torch.Tensor, entries: list, owners: list, pieces: list, me: int, n: int) -> list:
    """Cut the returned elements (ordered by owner, then entry) into one tensor per entry."""
    pos = {}
    at = 0
    for o in range(n):
        for k, (owner, pc) in enumerate(zip(owners, pieces)):
            if owner == o and pc[me][1] > pc[me][0]:
                pos[k] = at
                at += pc[me][1] - pc[me][0]
    out = []
    for k, (_, upd, _) in enumerate(entries):
        lo, hi = pieces[k][me]
        part = mine[pos[k]:pos[k] + hi - lo] if k in pos else mine[:0]
        out.append(part.view(upd.shape))
    return out
