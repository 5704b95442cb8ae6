"""Deferred initialization: record a model's construction on fake tensors, replay it unit by unit.

Four files, one responsibility each: ``_deferred_ops`` (what each aten op does), ``_deferred_graph`` (the
recorded graph and its bookkeeping), this module (recording, and the public entry points) and
``_deferred_replay`` (``materialize``/``release``).

This is the paper's (torchdistX-style) recorded deferred init::

    with deferred_init():
        model = Model()              # parameters and buffers are fake (meta) tensors; nothing allocated
    real = materialize([model.fc.weight, model.fc.bias])   # bit-equal to eager ``Model()``
    release(model)                   # drop the recording once every unit is materialized

How it works
------------
Inside the context, factory functions (``torch.empty``, ``randn``, ``arange``...) called without a
device create meta tensors ("fake"), and a ``TorchDispatchMode`` records every non-view aten op that
touches one. Tensors built from Python data (``torch.tensor([...])``) or with an explicit device stay
real, as in eager construction; when they meet fake tensors they are captured by value. The default
device stays CPU (``torch.get_default_device()``, ``torch.tensor([]).device``): Hugging Face skips
``_init_weights`` when it detects a meta-device context, eager construction would not.

Tensors are identified by their *storage*: views, ``detach()``, ``.data`` and ``nn.Parameter`` share
the StorageImpl of the tensor they come from, so an op argument is described as
``(storage key, size, stride, storage_offset, dtype)`` and view ops need not be recorded;
``param.data = other`` and tied weights need nothing special for the same reason.
:func:`materialize` replays the backward slice of the requested storages (ops that create or write
them, transitively their inputs; an op that overwrites a whole storage without reading it, like the
``normal_`` of ``_init_weights`` after a default ``kaiming_uniform_``, makes the earlier writes dead).

Invariants
----------
* Storage keys are StorageImpl addresses. While recording, the recording holds a strong reference to
  every fake storage, so no address is reused within a recording. When the ``with`` block exits,
  storages nobody else references (temporaries) are dropped; the others ("roots") stay referenced until
  :func:`release` (or until the caller drops every tensor on them), so :func:`is_deferred` stays exact.
* Random ops (``torch.Tag.nondeterministic_seeded`` or a ``generator`` argument) save the state of the
  generator they draw from, and advance the real generator exactly as eager construction would, by
  running the same op on real scratch memory with the same size/stride/offset. So the RNG state after
  the ``with`` block equals the eager one, and replay (a private generator restored to the saved state)
  draws the same numbers without touching the caller's global RNG.
* Real tensor arguments are captured by value (cloned) when the op is recorded.
* Replay runs on CPU, the device of eager construction, so values are bit-equal to eager CPU
  construction; :func:`materialize` moves the result to ``device`` afterwards.
* Model code that reads values (``.item()``, ``bool(t)``, ``.tolist()``; the rejection loop of
  ``nn.init.trunc_normal_`` in torch 2.13) is answered by replaying, then and there, what the value
  depends on, so control flow matches eager (``deferred_init(data_reads=False)`` raises instead).
* ``nn.init`` skips meta tensors (``trunc_normal_``, ``orthogonal_``...: "sampling is a no-op"); eager
  construction does not. While recording, ``Tensor.is_meta`` answers ``False`` for fake tensors of the
  active recording (a property installed on ``torch.Tensor`` for the duration of the block).

Limitations
-----------
* Only what runs *inside* the block is recorded: ``model.apply(init)`` after the block changes nothing.
* Ops with data-dependent output shapes (``nonzero``, boolean-mask indexing, ``unique``) on fake
  tensors raise :class:`DeferredInitError` (naming the op); meta tensors created outside the block
  cannot be used inside it.
* Random ops draw from the CPU generator, as eager construction on CPU does (a CUDA default device is
  not reproduced). Recording needs scratch memory of the largest randomly initialized tensor.
* The first use in a process may import ``torch._dynamo`` (meta kernels written as Python refs).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["deferred_init"]

aten = torch.ops.aten


from .graph import (  # the recorded graph
    _active,
    _Const,
    _drop,
    _FakeRef,
    _GEN,
    _keep_roots,
    _META,
    _Op,
    _Recording,
    _REGISTRY,
    _slice,
    _state,
    _storage_key,
)
from .ops import (  # what each aten op does
    _copies_out,
    _DATA_CONSTRUCTORS,
    _DATA_DEPENDENT,
    _FACTORIES,
    _get_generator,
    _HINT,
    _is_random,
    _meta_copy,
    _METADATA_ONLY_SELF,
    _OVERWRITE_PACKETS,
    _returns_self,
    _schema_index,
    _schema_values,
    _tensors_in,
)
from .replay import _Replay, _view
from .replay import is_deferred, materialize, release  # noqa: F401 - public API
from ..errors import DeferredInitError

# --------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------


class _RecordMode(TorchDispatchMode):
    """Records every non-view op that touches a fake tensor (or creates one on meta)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in dynamo.disable, whose first call imports torch._dynamo
        # (seconds). Model construction is never torch.compile'd, so the wrapper buys nothing here.
        return False

    def __init__(self, rec: _Recording, data_reads: bool):
        super().__init__()
        self.rec = rec
        self.data_reads = data_reads

    def _read_now(self, func, args, kwargs):
        """Answer a read of tensor values (``.item()``, ``bool(t)``) by replaying what it depends on.

        The answer only steers the model's Python control flow (e.g. the rejection loop of
        ``nn.init.trunc_normal_``), which later recorded ops then reflect; nothing is recorded for the
        read itself. Costs, once, the memory of the tensors read and their init temporaries.
        """
        fakes = [t for t in _tensors_in((args, kwargs)) if t.device.type == "meta"]
        keys = {_storage_key(t) for t in fakes}
        storages = _Replay(_slice(self.rec, keys), keep=keys).run()

        def real(a):
            if isinstance(a, torch.Tensor) and a.device.type == "meta":
                return _view(storages[_storage_key(a)], _FakeRef.of(a))
            return a

        return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _is_fake(self, t: torch.Tensor) -> bool:
        if t.device.type != "meta":
            return False
        key = _storage_key(t)
        if key not in self.rec.storages:
            raise DeferredInitError(
                "deferred_init: a meta tensor that was not created under this deferred_init() "
                f"(shape {tuple(t.shape)}) is used by the model's construction; its values are unknown, "
                "so it cannot be replayed. " + _HINT
            )
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        fake = [a for a in flat if isinstance(a, torch.Tensor) and self._is_fake(a)]
        to_meta = any(isinstance(a, torch.device) and a.type == "meta" for a in flat)
        if not fake and not to_meta:
            return func(*args, **kwargs)  # purely real op: eager semantics, nothing to record
        if func in _DATA_DEPENDENT or _copies_out(func, kwargs):
            if not self.data_reads:
                what = _DATA_DEPENDENT.get(func, "tensor.to(real device) / .cpu() / .tolist()")
                raise DeferredInitError(
                    f"deferred_init: `{func}` ({what}) reads the values of a deferred "
                    "(fake) tensor, which do not exist until materialize(), and data_reads=False. " + _HINT
                )
            return self._read_now(func, args, kwargs)
        if func.is_view:
            return func(*args, **kwargs)  # views share the storage; arguments are described by layout
        random = _is_random(func)
        if random and _returns_self(func):
            # In-place sampling (normal_, uniform_...) leaves the metadata unchanged, and the real run on
            # scratch below validates the arguments like eager. Skipping the meta kernel matters: for
            # normal_ it is a Python ref whose first call imports torch._dynamo (seconds).
            out = args[0]
        else:
            try:
                # real tensors meeting fake ones (e.g. `fake.add_(torch.tensor([...]))`) join them on
                # meta for the shape computation; the recording captures their values
                out = func(*tree_map(_meta_copy, args), **tree_map(_meta_copy, kwargs))
            except Exception as e:
                raise DeferredInitError(
                    f"deferred_init: `{func}` cannot run on deferred (fake) tensors: {e}. " + _HINT
                ) from e
        rng_state = self._advance_rng(func, args, kwargs) if random else None
        self._record(func, args, kwargs, out, rng_state)
        return out

    def _advance_rng(self, func, args, kwargs) -> torch.Tensor:
        """Save the generator state, then consume exactly what eager would, on a scratch tensor.

        The scratch has the same size/stride/offset as the fake argument, because CPU kernels draw in
        a layout-dependent order (e.g. vectorized normal_ on contiguous tensors). Values of non-written
        inputs (p of bernoulli, std of normal) do not change how much is drawn; 0.5 keeps them valid.
        """
        gen = _get_generator(func, args, kwargs) or torch.default_generator
        state = gen.get_state()
        mutated = {id(t) for arg, v in _schema_values(func, args, kwargs)
                   if arg.alias_info is not None and arg.alias_info.is_write for t in _tensors_in(v)}
        slot = iter(range(1 << 30))

        def scratch(a):
            if isinstance(a, torch.device) and a.type == "meta":
                return torch.device("cpu")
            if not isinstance(a, torch.Tensor) or a.device.type != "meta":
                return a
            numel = self.rec.nbytes[_storage_key(a)] // a.element_size()
            base = self._scratch(next(slot), numel * a.element_size()).view(a.dtype)
            if id(a) not in mutated:
                base.fill_(True if a.dtype == torch.bool else 0.5 if a.is_floating_point() else 1)
            return base.as_strided(a.shape, a.stride(), a.storage_offset())

        func(*tree_map(scratch, args), **tree_map(scratch, kwargs))
        return state

    def _scratch(self, slot: int, nbytes: int) -> torch.Tensor:
        """`nbytes` of reusable CPU scratch memory for the `slot`-th tensor argument of a random op.

        Reused across ops (grown when needed, freed when recording ends) rather than allocated per op:
        with per-op allocations, the small long-lived allocations made between two ops (saved RNG
        states) land inside the freed block, so every layer-sized scratch needs fresh pages and RSS
        grows by a whole model's worth of memory.
        """
        buffers = self.rec.scratch
        while len(buffers) <= slot:
            buffers.append(torch.empty(0, dtype=torch.uint8, device="cpu"))
        if buffers[slot].numel() < nbytes:
            buffers[slot] = torch.empty(0, dtype=torch.uint8, device="cpu")  # free before growing
            buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        return buffers[slot][:nbytes]

    def _record(self, func, args, kwargs, out, rng_state) -> None:
        rec = self.rec
        writes: set[int] = set()
        for arg, value in _schema_values(func, args, kwargs):
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in _tensors_in(value):
                    if t.device.type != "meta":
                        raise DeferredInitError(
                            f"deferred_init: `{func}` writes a real tensor from deferred (fake) values. " + _HINT
                        )
                    writes.add(_storage_key(t))
        reads = {_storage_key(t) for t in _tensors_in((args, kwargs)) if t.device.type == "meta"}

        outputs: list[_FakeRef | None] = []
        creates: dict[int, int] = {}
        for o in tree_flatten(out)[0]:
            if not isinstance(o, torch.Tensor) or o.device.type != "meta":
                outputs.append(None)
                continue
            key = _storage_key(o)
            if key not in rec.storages:  # a new fake storage: keep it alive (unique key)
                storage = o.untyped_storage()
                rec.storages[key] = storage
                rec.nbytes[key] = storage.nbytes()
                _REGISTRY[key] = rec
                creates[key] = storage.nbytes()
            outputs.append(_FakeRef.of(o))
        if not writes and not creates:
            return  # an alias of existing storage (e.g. _unsafe_view): described by layout, no effect

        name = func.overloadpacket.__name__
        kills: dict[int, int] = {}
        meta_only: set[int] = set()
        if name in _OVERWRITE_PACKETS and args and isinstance(args[0], torch.Tensor):
            self_ref = _FakeRef.of(args[0])
            others = {_storage_key(t) for t in _tensors_in((args[1:], kwargs)) if t.device.type == "meta"}
            if self_ref.key not in others and self_ref.covers(rec.nbytes[self_ref.key]):
                kills[self_ref.key] = rec.nbytes[self_ref.key]
        if name in _METADATA_ONLY_SELF and args and isinstance(args[0], torch.Tensor):
            meta_only.add(_storage_key(args[0]))

        def template(a):
            if isinstance(a, torch.Tensor):
                if a.device.type == "meta":
                    return _FakeRef.of(a)
                return _Const(a.detach().clone())
            if isinstance(a, torch.device) and a.type == "meta":
                return _META
            if isinstance(a, torch.Generator):
                return _GEN
            return a

        rec.ops.append(_Op(
            index=len(rec.ops), func=func, args=tree_map(template, args), kwargs=tree_map(template, kwargs),
            reads=frozenset((reads - kills.keys()) - meta_only), writes=frozenset(writes), creates=creates,
            kills=kills, outputs=outputs, rng_state=rng_state,
            gen_index=_schema_index(func, "generator"), default_dtype=torch.get_default_dtype(),
            meta_only=frozenset(meta_only),
        ))


class _FactoryMode(TorchFunctionMode):
    """Factory functions without an explicit ``device=`` create fake (meta) tensors.

    Unlike ``with torch.device("meta")``, the default device stays CPU for everything else, as in
    eager construction: ``torch.get_default_device()`` and ``torch.tensor([]).device`` say CPU (Hugging
    Face skips ``_init_weights`` when they say meta), and tensors built from Python data
    (``torch.tensor([...])``, ``as_tensor``) stay real, so their values are never lost.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": torch.device("meta")}
        elif func in _DATA_CONSTRUCTORS or func is torch.Tensor.new_tensor:
            return _from_data(func, args, kwargs)
        return func(*args, **kwargs)


def _from_data(func, args, kwargs):
    """``torch.tensor(data, device=fake.device)``, ``fake.new_tensor(data)``: on meta the data would be
    dropped silently. Build the tensor on CPU, then move it to meta through the dispatch mode, which
    records that copy with the CPU tensor captured by value."""
    is_method = func is torch.Tensor.new_tensor
    data = args[1] if is_method else (args[0] if args else kwargs.get("data"))
    device = kwargs.get("device")
    if device is None and is_method:
        device = args[0].device
    if isinstance(data, torch.Tensor) or device is None or torch.device(device).type != "meta":
        return func(*args, **kwargs)
    return func(*args, **{**kwargs, "device": torch.device("cpu")}).to("meta")


_ORIG_IS_META = torch._C.TensorBase.is_meta


def _is_meta_while_recording(self) -> bool:
    """Fake tensors look real to model code (nn.init skips meta tensors, eager would not)."""
    meta = _ORIG_IS_META.__get__(self)
    rec = _active()
    if meta and rec is not None and rec.recording and _storage_key(self) in rec.storages:
        return False
    return meta


_patch_lock = threading.Lock()
_patch_users = 0  # recordings (threads) currently relying on the is_meta override


@contextlib.contextmanager
def _is_meta_patched():
    """Install the is_meta override on torch.Tensor while at least one thread records."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            torch.Tensor.is_meta = property(_is_meta_while_recording, doc=_ORIG_IS_META.__doc__)
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                del torch.Tensor.is_meta  # back to TensorBase's getter


@contextlib.contextmanager
def deferred_init(data_reads: bool = True):
    """Construct modules with fake (meta) parameters and buffers, recording how to make them real.

    `data_reads`: model code that reads tensor values into Python (``.item()``, ``bool(t)``,
    ``torch.equal``; e.g. the rejection loop of ``nn.init.trunc_normal_`` in torch >= 2.13) is answered
    by replaying, right then, the ops that value depends on (memory: the tensors read, once).
    With ``data_reads=False`` such reads raise :class:`DeferredInitError` instead.

    Nested use is a no-op (the outer recording continues). On exit, the global RNG is in the state eager
    construction would have left it in. Tensors created inside are deferred (:func:`is_deferred`) until
    :func:`release`. Ops applied to them *after* the block are not recorded.
    """
    if _active() is not None:
        yield
        return
    rec = _Recording()
    _state.recording = rec
    ok = False
    try:
        with _FactoryMode(), _RecordMode(rec, data_reads), _is_meta_patched():
            yield
        ok = True
    finally:
        _state.recording = None
        rec.recording = False
        rec.scratch = []
        if ok:
            _keep_roots(rec)
        else:
            _drop(rec, set(rec.storages))
