"""Deferred init, part 4: replay. ``materialize`` re-runs only the recorded ops that the requested tensors
depend on (a backward slice of the recording), on real storages, without touching the global RNG."""
from __future__ import annotations

import contextlib
import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .graph import (
    _Const,
    _FakeRef,
    _GEN,
    _META,
    _Op,
    _REGISTRY,
    _Recording,
    _active,
    _collect,
    _drop,
    _slice,
    _storage_key,
)
from .ops import _with_generator
from ..errors import DeferredInitError, NotDeferredError


def is_deferred(t: torch.Tensor) -> bool:
    """True if `t` (a parameter, buffer, or a view of one) is a fake tensor of a live recording."""
    if not isinstance(t, torch.Tensor) or t.device.type != "meta":
        return False
    return _storage_key(t) in _REGISTRY


def _plan(tensors: list[torch.Tensor]) -> list[_Op]:
    """The ops :func:`materialize` would replay for `tensors` (used by tests and diagnostics)."""
    ops: dict[int, _Op] = {}
    for rec, keys in _group(tensors).items():
        for op in _slice(rec, keys):
            ops[id(op)] = op
    return list(ops.values())


def _group(tensors: list[torch.Tensor]) -> dict[_Recording, set[int]]:
    groups: dict[int, tuple[_Recording, set[int]]] = {}
    for i, t in enumerate(tensors):
        if not t.is_meta:
            continue  # real already (torch.tensor(data), explicit device): materialize passes it through
        if not is_deferred(t):
            raise NotDeferredError(
                f"materialize: tensor #{i} (shape {tuple(t.shape)}, device {t.device}) is not deferred: "
                "it was not created under deferred_init(), or it was already released."
            )
        key = _storage_key(t)
        rec = _REGISTRY[key]
        groups.setdefault(id(rec), (rec, set()))[1].add(key)
    return {rec: keys for rec, keys in groups.values()}


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a 1-D uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _view(storage: torch.UntypedStorage, ref: _FakeRef) -> torch.Tensor:
    t = torch.empty(0, dtype=ref.dtype, device=storage.device)
    return t.set_(storage, ref.offset, ref.size, ref.stride)


class _Replay:
    """Replays a slice on real CPU storages. `storages` maps fake storage key -> real storage."""

    def __init__(self, ops: list[_Op], keep: set[int]):
        self.ops = ops
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.owners: set[int] = set()  # real storage addresses already bound to some key
        last_use: dict[int, int] = {}
        for i, op in enumerate(ops):
            for k in op.reads | op.writes | op.creates.keys() | op.meta_only:
                last_use[k] = i
        # storages not requested are freed right after their last use: peak = requested + live temps
        self.free_after: dict[int, list[int]] = {}
        for k, i in last_use.items():
            if k not in keep:
                self.free_after.setdefault(i, []).append(k)

    def run(self) -> dict[int, torch.UntypedStorage]:
        for i, op in enumerate(self.ops):
            self._run_op(op)
            for k in self.free_after.get(i, ()):
                self.storages.pop(k, None)
        return self.storages

    def _arg(self, op: _Op, a):
        if isinstance(a, _FakeRef):
            if a.key not in self.storages and a.key in op.kills:  # overwritten whole: fresh memory
                self.storages[a.key] = torch.UntypedStorage(op.kills[a.key], device="cpu")
                self.owners.add(self.storages[a.key]._cdata)
            if a.key in self.storages:
                return _view(self.storages[a.key], a)
            if a.key in op.meta_only:  # only its shape/dtype matter; uninitialized memory is fine
                return torch.empty_strided(a.size, a.stride, dtype=a.dtype, device="cpu")
            raise DeferredInitError(f"materialize: internal error, `{op.func}` reads an unknown storage")
        if isinstance(a, _Const):
            return a.value
        if a is _META:
            return torch.device("cpu")
        if a is _GEN:
            return None  # replaced below by a private generator
        return a

    def _run_op(self, op: _Op) -> None:
        args = tree_map(lambda a: self._arg(op, a), op.args, is_leaf=_is_template_leaf)
        kwargs = tree_map(lambda a: self._arg(op, a), op.kwargs, is_leaf=_is_template_leaf)
        with _default_dtype(op.default_dtype), _rng_for(op, args, kwargs) as (args, kwargs):
            out = op.func(*args, **kwargs)
        for ref, real in zip(op.outputs, tree_flatten(out)[0]):
            if ref is not None:
                self._bind(ref, real, op)

    def _bind(self, ref: _FakeRef, real: torch.Tensor, op: _Op) -> None:
        """Make storage `ref.key` hold `real` at the recorded layout (adopt real's storage if possible)."""
        storage = real.untyped_storage()
        if ref.key in self.storages:
            if self.storages[ref.key]._cdata != storage._cdata:  # e.g. out-of-place op, recorded alias
                _view(self.storages[ref.key], ref).copy_(real)
            return
        layout_ok = (tuple(real.shape) == ref.size and tuple(real.stride()) == ref.stride
                     and real.storage_offset() == ref.offset and real.dtype == ref.dtype
                     and storage.nbytes() == op.creates.get(ref.key, -1))
        if layout_ok and storage._cdata not in self.owners:
            self.storages[ref.key] = storage
        else:  # meta and CPU kernels disagree on layout, or the real op aliased: copy to be exact
            nbytes = op.creates.get(ref.key, storage.nbytes())
            self.storages[ref.key] = torch.UntypedStorage(nbytes, device="cpu")
            _view(self.storages[ref.key], ref).copy_(real)
        self.owners.add(self.storages[ref.key]._cdata)


def _is_template_leaf(a) -> bool:
    return isinstance(a, (_FakeRef, _Const))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Factory ops resolve dtype=None at run time: replay under the default dtype of recording time."""
    old = torch.get_default_dtype()
    if old == dtype:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _rng_for(op: _Op, args, kwargs):
    """Give a random op the generator state it started from, without touching the global RNG."""
    if op.rng_state is None:
        yield args, kwargs
        return
    if op.gen_index is not None:
        gen = torch.Generator(device="cpu")
        gen.set_state(op.rng_state)
        yield _with_generator(op.func, args, kwargs, gen)
        return
    # ops without a generator argument (randn.default, randperm.default...) draw from the default one
    saved = torch.default_generator.get_state()
    torch.default_generator.set_state(op.rng_state)
    try:
        yield args, kwargs
    finally:
        torch.default_generator.set_state(saved)


def materialize(tensors: list[torch.Tensor], device=torch.device("cpu")) -> list[torch.Tensor]:
    """Real tensors for deferred `tensors`, bit-equal to eager construction under the same seed.

    Only the recorded ops these tensors depend on are replayed (a backward slice), so peak memory is
    about the requested tensors plus the temporaries of their init ops. Replay uses private generators:
    the caller's RNG state is unchanged. Can be called any number of times, in any order.

    The result has one entry per input, with the same shape, dtype, strides and storage offset.
    Inputs that share a fake storage (tied parameters, a parameter and a view of it) get views of ONE
    real storage in the same call; separate calls give separate (equal) copies. Results do not
    require grad; the caller wraps them (e.g. ``nn.Parameter``) and re-ties as needed.
    Inputs that are already real (built from data, e.g. ``torch.tensor(0)``, or with an explicit
    device inside the block) come back detached, moved to `device` (no copy if already there).
    A meta tensor that is not deferred (or was released) raises ``ValueError``.
    """
    if _active() is not None:
        raise DeferredInitError("materialize() cannot be called inside deferred_init()")
    tensors = list(tensors)
    device = torch.device(device)
    real: dict[int, torch.UntypedStorage] = {}
    for rec, keys in _group(tensors).items():
        _collect(rec)  # `tensors` holds the requested storages, so they survive this
        storages = _Replay(_slice(rec, keys), keep=keys).run()
        for k in keys:
            if k not in storages:  # created by an op that was never recorded: cannot happen for roots
                raise DeferredInitError("materialize: no recorded op creates this tensor's storage")
            real[k] = storages[k]
    if device.type != "cpu":  # move each storage once, so ties and views stay shared on `device`
        real = {k: _bytes(s).to(device).untyped_storage() for k, s in real.items()}
    return [_view(real[_storage_key(t)], _FakeRef.of(t)) if t.is_meta else t.detach().to(device)
            for t in tensors]


def release(module_or_tensors) -> None:
    """Forget the recordings of these tensors (a module: its parameters and buffers).

    Afterwards they are no longer deferred, and recorded ops that no remaining deferred tensor needs
    are dropped (with their captured constants and RNG states), so memory is freed as units are done.
    """
    if isinstance(module_or_tensors, nn.Module):
        tensors = [*module_or_tensors.parameters(), *module_or_tensors.buffers()]
    elif isinstance(module_or_tensors, torch.Tensor):
        tensors = [module_or_tensors]
    else:
        tensors = list(module_or_tensors)
    by_rec: dict[int, tuple[_Recording, set[int]]] = {}
    for t in tensors:
        if is_deferred(t):
            key = _storage_key(t)
            rec = _REGISTRY[key]
            by_rec.setdefault(id(rec), (rec, set()))[1].add(key)
    for rec, keys in by_rec.values():
        _drop(rec, keys)
    # parameters the engine already swapped for real ones are no longer reachable: free their ops too
    for rec in {id(r): r for r in _REGISTRY.values()}.values():
        _collect(rec)
