"""Deferred init, part 1: the recorded graph (fake-tensor references, ops, recordings, which ops a set of
storages needs) and the schema helpers that recording (``_deferred``) and replay (``_deferred_replay``) share."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten

from .errors import DeferredInitError

aten = torch.ops.aten


_HINT = (
    "Build this module eagerly (outside deferred_init()), or on torch.device('meta') with a "
    "reset_parameters() that initializes it without reading tensor values."
)

# Ops that read tensor *values* into Python. On a fake tensor they are answered by replaying what the
# value depends on (deferred_init(data_reads=True), the default), or raise (data_reads=False).
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "Tensor.item() / .tolist() / bool(tensor) / `if tensor:`",
    aten.equal.default: "torch.equal()",
    aten.is_nonzero.default: "bool(tensor) / `if tensor:`",
}

# In-place ops that overwrite every element of `self` without reading its old values. If such an op
# covers the whole storage, earlier writes to that storage are dead and need not be replayed.
_OVERWRITE_PACKETS = {
    "uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "exponential_", "cauchy_",
    "log_normal_", "geometric_", "bernoulli_",
}

# Ops that use `self` (args[0]) only for its metadata (shape, dtype, strides), never its values.
_METADATA_ONLY_SELF = {
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
}

# Python-level factory functions that allocate (no data argument): these become fake when no device is
# given. Constructors from data (torch.tensor, as_tensor, asarray) and sparse/nested ones stay real.
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = {
    f for f in _device_constructors()
    if getattr(f, "__name__", "") not in {"tensor", "as_tensor", "asarray", "nested_tensor", "empty_quantized"}
    and not getattr(f, "__name__", "").startswith("sparse_")
}


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
    counter = getattr(torch._C, "_storage_Use_Count", None)
    return counter(storage._cdata) if counter is not None else 2  # unknown: assume referenced


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags or _schema_index(func, "generator") is not None


def _copies_out(func, kwargs) -> bool:
    """``fake.to("cpu")`` (also behind ``.tolist()``): a real tensor from fake values, a data read."""
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "meta"


def _meta_copy(a):
    if isinstance(a, torch.Tensor) and a.device.type != "meta":
        return a.to("meta")
    return a


def _returns_self(func) -> bool:
    """`func(self, ...) -> Tensor(a!)`: an in-place op returning its (mutated) first argument."""
    schema = func._schema
    if len(schema.returns) != 1 or not schema.arguments:
        return False
    first, ret = schema.arguments[0], schema.returns[0]
    return (first.alias_info is not None and first.alias_info.is_write and ret.alias_info is not None
            and ret.alias_info.before_set == first.alias_info.before_set)


def _schema_index(func, name: str) -> int | None:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return i
    return None


def _schema_values(func, args, kwargs):
    """Yield (schema argument, value) pairs for the arguments actually passed."""
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def _tensors_in(value) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _get_generator(func, args, kwargs):
    i = _schema_index(func, "generator")
    if i is None:
        return None
    if i < len(args):
        return args[i]
    return kwargs.get("generator")


def _with_generator(func, args, kwargs, gen):
    """Return (args, kwargs) with the op's generator argument set to `gen`."""
    i = _schema_index(func, "generator")
    if i < len(args):
        args = list(args)
        args[i] = gen
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    kwargs["generator"] = gen
    return args, kwargs


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
