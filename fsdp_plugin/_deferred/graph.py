"""Deferred init, part 2: the recorded graph (fake-tensor references, ops, recordings, the registry of live
recordings) and its bookkeeping (which recorded ops a set of storages needs, what to keep or drop)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from .. import _compat


aten = torch.ops.aten


# --------------------------------------------------------------------------------------------------
# Data structures
# --------------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int | None:
    """Address of t's StorageImpl (shared by every view / detach / Parameter of it), or None."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without storage
        return None


@dataclass(frozen=True)
class _FakeRef:
    """A fake tensor argument: where it lives in its storage, not what it contains."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "_FakeRef":
        return _FakeRef(_storage_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def covers(self, nbytes: int) -> bool:
        """True if this view is dense, non-overlapping and spans exactly the whole storage."""
        if self.offset != 0:
            return False
        numel = 1
        for s in self.size:
            numel *= s
        if numel * self.dtype.itemsize != nbytes:
            return False
        expected = 1
        for size, stride in sorted(zip(self.size, self.stride), key=lambda p: p[1]):
            if size == 1:
                continue
            if stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True)
class _Const:
    """A real tensor argument, captured by value when the op was recorded."""

    value: torch.Tensor


class _MetaDevice:
    """Placeholder for a ``device=meta`` argument; replay substitutes the replay device."""


_META = _MetaDevice()


class _GenSlot:
    """Placeholder for a ``generator=`` argument; replay substitutes a generator restored to `state`."""


_GEN = _GenSlot()


@dataclass(eq=False)
class _Op:
    """One recorded aten op.

    `reads`: storages whose values the op may read; `writes`: existing storages it modifies;
    `creates`: new storages it returns (key -> nbytes); `kills`: storages it overwrites entirely
    without reading (earlier writers of those are dead). `outputs` mirrors the flattened result.
    """

    index: int
    func: Any
    args: Any
    kwargs: Any
    reads: frozenset[int]
    writes: frozenset[int]
    creates: dict[int, int]
    kills: dict[int, int]  # key -> nbytes: replay allocates it if its (dead) creator was sliced away
    outputs: list[_FakeRef | None]
    rng_state: torch.Tensor | None
    gen_index: int | None  # schema position of `generator`, None if the op has none
    default_dtype: torch.dtype
    meta_only: frozenset[int] = frozenset()  # keys used for metadata only (see _METADATA_ONLY_SELF)


@dataclass(eq=False)
class _Recording:
    ops: list[_Op] = field(default_factory=list)
    # key -> fake UntypedStorage (strong ref keeps the address unique); after exit only roots remain.
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    roots: set[int] = field(default_factory=set)
    recording: bool = True
    scratch: list[torch.Tensor] = field(default_factory=list)  # see _RecordMode._scratch


_REGISTRY: dict[int, _Recording] = {}  # storage key -> recording, for every live deferred storage
_state = threading.local()


def _active() -> _Recording | None:
    return getattr(_state, "recording", None)


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to the StorageImpl (tensors, views, Parameters, our own storage object)."""
    n = _compat.storage_use_count(storage)
    return n if n is not None else 2  # unknown: assume referenced


def _keep_roots(rec: _Recording) -> None:
    """After recording: keep only storages still referenced outside the recording, and their ops."""
    # No gc.collect() (it costs ~1 s in a large process): a temporary kept alive only by a reference
    # cycle counts as a root for now, which is conservative; _collect() drops it once it is freed.
    rec.roots = {k for k, s in rec.storages.items() if _use_count(s) > 1}
    _drop(rec, set(rec.storages) - rec.roots)


def _collect(rec: _Recording) -> None:
    """Drop roots that nothing outside the recording references any more.

    E.g. after the engine replaced ``p.data`` by the materialized tensor, the fake storage is only held
    by the recording: its ops are dead. Keeps memory bounded even without explicit :func:`release`.
    """
    dead = {k for k in rec.roots if _use_count(rec.storages[k]) <= 1}
    if dead:
        _drop(rec, dead)


def _drop(rec: _Recording, keys: set[int]) -> None:
    """Forget `keys` (no longer deferred) and every op that no remaining root needs."""
    for k in keys:
        rec.storages.pop(k, None)
        rec.roots.discard(k)
        if _REGISTRY.get(k) is rec:
            del _REGISTRY[k]
    rec.ops = _slice(rec, rec.roots)



def _slice(rec: _Recording, keys: Iterable[int]) -> list[_Op]:
    """The recorded ops needed to compute storages `keys`, in recording order.

    Backward pass: an op is needed if it creates or writes a live storage; its inputs become live.
    An op that overwrites a whole storage without reading it ends that storage's liveness (earlier
    writes are dead), which e.g. skips a default kaiming init that `_init_weights` replaces.
    """
    live = set(keys)
    needed: list[_Op] = []
    for op in reversed(rec.ops):
        if live.isdisjoint(op.writes) and live.isdisjoint(op.creates):
            continue
        needed.append(op)
        live -= op.kills.keys()
        live -= op.creates.keys()
        live |= op.reads
    needed.reverse()
    return needed
