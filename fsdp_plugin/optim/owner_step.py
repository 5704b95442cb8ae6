"""The generic owner step: a stock per-tensor optimizer (``torch.optim.Adafactor``, ``torch.optim.Muon``,
classes marked with ``fp.optim.register_per_tensor``) on a sharded model runs its own ``step`` on full
tensors, exactly.

Contract of a per-tensor optimizer: its step updates each parameter from that parameter's own full tensors
(parameter, gradient, state) and issues no collectives, so running it on a different subset of the
parameters on each rank is running it on all of them.

Per step (the guards' global step hooks call :func:`before` and :func:`after` around the stock step):

* ``before``: per flat handle, one all-to-all sends every split parameter's rows (parameter, then
  gradient, in the handle's dtype) to its owner (``fp.param_info(p).owner``), which builds the full tensor
  ``q`` with ``q.grad``. Each group's ``params`` becomes: the parameters whole on this rank, and ``q`` in
  place of each split parameter this rank owns; pieces it does not step (empty here, or owned elsewhere)
  leave the list. The state of ``p`` moves to key ``q``.
* the stock ``step`` runs on exactly those tensors;
* ``after``: groups and state keys come back, and per handle one all-to-all returns each holder its rows.

State invariant: a parameter's state lives whole on the one rank that steps it (the owner of a split
parameter, the holder of a whole one); other ranks hold none. Checkpoints save a split parameter's state
inline from its owner (``checkpoint/optim.py``); a load that lands per-element pieces on a split parameter
is settled by :func:`settle_loaded` (pieces to the owner). Cost per step: 8 bytes there (parameter and
gradient, fp32) and 4 back per element of a split parameter that is not on its owner.
"""
from __future__ import annotations

import torch

from .._flat.layout import param_info
from ..errors import OptimizerError
from ._exchange import exchange

_CTX = "_fp_owner_step"


_REGISTERED: set = set()


def register_per_tensor(cls: type) -> type:
    """Mark optimizer class ``cls`` (and its subclasses) as per-tensor: its step updates each parameter from
    that parameter's own full tensors and state, with no collectives. On a sharded model it then runs the
    owner step (exact: the stock step on full tensors)."""
    _REGISTERED.add(cls)
    return cls


def applies(cls: type) -> bool:
    """Whether optimizer class ``cls`` gets the owner step: torch's Adafactor and Muon (stock; fp.optim.Muon
    is sharding-aware and cheaper: bf16 updates only) and registered per-tensor classes."""
    if getattr(cls, "_fp_sharding_aware", False):
        return False
    return issubclass(cls, (torch.optim.Adafactor, torch.optim.Muon)) or any(issubclass(cls, r) for r in _REGISTERED)


def is_owner_stepped(opt) -> bool:
    """Whether ``opt`` runs the owner step when its parameters are sharded (for the checkpoint layer)."""
    return applies(type(opt))


def state_is_whole(opt, p) -> bool:
    """Whether ``opt``'s state of ``p`` is whole (owner step, ``p`` split): scalar state in checkpoints."""
    return getattr(p, "_fp_handle", None) is not None and is_owner_stepped(opt) and param_info(p).split


def _slot(p) -> int:
    return next(i for i, s in enumerate(p._fp_handle.slots) if s.param is p)


def _plan(opt) -> tuple[set, dict]:
    """(ids of the tensors this rank steps as they are, {id(handle): (handle, [(slot, p)])} of split ones)."""
    keep, split = set(), {}
    for g in opt.param_groups:
        for p in g["params"]:
            h = getattr(p, "_fp_handle", None)
            if h is None or (not param_info(p).split and p.numel() > 0):
                keep.add(id(p))
            elif param_info(p).split and p.grad is not None:     # grad presence agrees across ranks
                split.setdefault(id(h), (h, []))[1].append((_slot(p), p))
    for _, entries in split.values():
        entries.sort(key=lambda e: e[0])
    return keep, split


def _pieces(h, entries: list) -> tuple[list, list]:
    n = h.mesh.shard_size
    return [[h.piece_of(h.slots[i], j) for j in range(n)] for i, _ in entries], [h.owners[i] for i, _ in entries]


def _to_owners(h, entries: list, tensors_of) -> dict:
    """Send every holder's rows of ``tensors_of(p)`` (a list of same-shape tensors) to the owner of ``p``;
    returns ``{id(p): [full flat tensor, ...]}`` for the parameters this rank owns. Collective over the group."""
    n, me = h.mesh.shard_size, h.mesh.shard_rank
    pieces, owners = _pieces(h, entries)
    k = len(tensors_of(entries[0][1]))
    dtype = tensors_of(entries[0][1])[0].dtype
    there = [[] for _ in range(n)]
    for (_, p), o, pc in zip(entries, owners, pieces):
        if pc[me][1] > pc[me][0]:
            there[o] += [t.detach().reshape(-1).to(dtype) for t in tensors_of(p)]
    splits = [k * sum(pc[j][1] - pc[j][0] for pc, o in zip(pieces, owners) if o == me) for j in range(n)]
    got = exchange(h, there, splits, "there", dtype, "owner step")
    pos = [sum(splits[:j]) for j in range(n)]
    out = {}
    for (i, p), o, pc in zip(entries, owners, pieces):
        if o != me:
            continue
        full = [torch.empty(h.slots[i].numel, dtype=dtype, device=h.device) for _ in range(k)]
        for j, (lo, hi) in enumerate(pc):
            for t in full:
                t[lo:hi] = got[pos[j]:pos[j] + hi - lo]
                pos[j] += hi - lo
        out[id(p)] = full
    return out


def before(opt) -> None:
    """Gather split parameters to their owners and point the optimizer at the tensors this rank steps."""
    if getattr(opt, _CTX, None) is not None:
        raise OptimizerError(f"{type(opt).__name__}: the previous step raised inside the owner step; rebuild the "
                             "optimizer (or reload its checkpoint) before stepping again")
    keep, split = _plan(opt)
    swap = {}
    for h, entries in split.values():
        if any(p.grad.dtype != p.dtype for _, p in entries):
            raise OptimizerError(f"{type(opt).__name__}: gradients in a dtype other than the parameters' are not "
                                 "supported by the owner step; keep .grad in the parameter dtype")
        full = _to_owners(h, entries, lambda p: [p, p.grad])
        for _, p in entries:
            if id(p) in full:
                q = full[id(p)][0].view(param_info(p).shape)
                q.grad = full[id(p)][1].view(q.shape)
                swap[id(p)] = (p, q)
    groups = [g["params"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["params"] = [swap[id(p)][1] if id(p) in swap else p for p in g["params"] if id(p) in keep or id(p) in swap]
    for params in groups:
        for p in params:
            if id(p) in swap and p in opt.state:
                opt.state[swap[id(p)][1]] = opt.state.pop(p)
            elif id(p) not in keep:
                opt.state.pop(p, None)
    setattr(opt, _CTX, (groups, swap, split))


def after(opt) -> None:
    """Restore the groups and state keys; return every holder its rows of the updated parameters."""
    ctx = getattr(opt, _CTX, None)
    if ctx is None:
        return
    groups, swap, split = ctx
    for g, params in zip(opt.param_groups, groups):
        g["params"] = params
    for p, q in swap.values():
        if q in opt.state:
            opt.state[p] = opt.state.pop(q)
    for h, entries in split.values():
        _from_owners(h, entries, swap)
    setattr(opt, _CTX, None)


def _from_owners(h, entries: list, swap: dict) -> None:
    """Each owner sends each holder its rows of the updated full parameter; holders copy them in."""
    n, me = h.mesh.shard_size, h.mesh.shard_rank
    pieces, owners = _pieces(h, entries)
    back = [[] for _ in range(n)]
    for (_, p), o, pc in zip(entries, owners, pieces):
        if o == me:
            flat = swap[id(p)][1].reshape(-1)
            for j, (lo, hi) in enumerate(pc):
                if hi > lo:
                    back[j].append(flat[lo:hi])
    splits = [sum(pc[me][1] - pc[me][0] for pc, o in zip(pieces, owners) if o == j) for j in range(n)]
    got = exchange(h, back, splits, "back", entries[0][1].dtype, "owner step")
    pos = [sum(splits[:j]) for j in range(n)]
    for (_, p), o, pc in zip(entries, owners, pieces):
        lo, hi = pc[me]
        if hi > lo:
            with torch.no_grad():
                p.copy_(got[pos[o]:pos[o] + hi - lo].view(p.shape))
            pos[o] += hi - lo


def settle_loaded(opt, loaded: dict) -> None:
    """After a checkpoint load: per-element state pieces of split parameters (``loaded``: ``{id(p): keys}``
    read as pieces, the same on every rank) go whole to the owner; ranks that do not step a parameter drop
    its state. Collective over each split parameter's shard group."""
    keep, _ = _plan(opt)
    split = {}
    for g in opt.param_groups:
        for p in g["params"]:
            if getattr(p, "_fp_handle", None) is not None and param_info(p).split:
                split.setdefault(id(p._fp_handle), (p._fp_handle, []))[1].append((_slot(p), p))
    for h, entries in split.values():
        entries.sort(key=lambda e: e[0])
        for key in sorted({k for _, p in entries for k in loaded.get(id(p), ())}):
            have = [(i, p) for i, p in entries if key in loaded.get(id(p), ())]
            full = _to_owners(h, have, lambda p: [opt.state[p][key]])
            for _, p in have:
                if id(p) in full:
                    opt.state[p][key] = full[id(p)][0].view(param_info(p).shape).to(opt.state[p][key].dtype)
        for _, p in entries:
            if p._fp_handle.owners[_slot(p)] != p._fp_handle.mesh.shard_rank:
                opt.state.pop(p, None)
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in keep and not (getattr(p, "_fp_handle", None) is not None and param_info(p).split):
                opt.state.pop(p, None)
