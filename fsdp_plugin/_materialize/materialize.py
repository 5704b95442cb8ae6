"""Materializing a unit's full parameter values at shard time, one unit at a time.

Three sources: real tensors (on rank 0 they win: chunks are scattered from it), meta tensors
(initialized by ``param_init_fn`` or each module's own ``reset_parameters()``, exactly once per module),
and tensors recorded under ``fp.deferred_init()`` (replayed, bit-equal to eager construction).
"""
from __future__ import annotations

from enum import IntEnum

import torch
from torch import nn

from .. import _deferred
from .._comm import collectives as comm
from .._flat.flat_param import set_param_data
from .._flat import packed_quantize
from .hf_init import HFInit
from .._flat.layout import is_persistent_buffer
from ..config import SKIP_INIT
from ..errors import ShardingError

class TensorKind(IntEnum):
    """Where a tensor's values come from; ordered so that a model's kind is the max of its tensors' kinds."""
    REAL = 0
    META = 1       # built on the meta device: initialize (param_init_fn / reset_parameters / _init_weights)
    DEFERRED = 2   # recorded by fp.deferred_init: replay the recording


REAL, META, DEFERRED = TensorKind.REAL, TensorKind.META, TensorKind.DEFERRED


def tensor_kind(t: torch.Tensor) -> TensorKind:
    src = getattr(t, "_fp_float", None)     # a deferred 4-bit weight, packed shape until built (``packed_quantize``)
    if src is not None:
        return tensor_kind(src)
    if t.is_meta:
        return DEFERRED if _deferred.is_deferred(t) else META
    return REAL


def model_kind(model: nn.Module) -> int:
    kinds = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        kinds.setdefault(tensor_kind(t), name)
    if DEFERRED in kinds and META in kinds:
        raise ShardingError(
            f"{kinds[META]!r} is on the meta device but was not recorded by fp.deferred_init(), while "
            f"{kinds[DEFERRED]!r} was: the model was changed after the deferred_init block (e.g. model.to(dtype)), "
            "which cannot be replayed. Do it inside the block, or use fp.MixedPrecision / the dtype at construction")
    return max(kinds) if kinds else REAL


def decide_scatter(model: nn.Module, world_size: int, device: torch.device) -> bool:
    """True when rank 0 holds real values that every rank must take (rank 0 wins)."""
    if world_size == 1:
        return False
    kinds = torch.tensor([model_kind(model)], dtype=torch.int64, device=device)
    gathered = torch.zeros(world_size, dtype=torch.int64, device=device)
    comm.all_gather(gathered, kinds, None, kind="control")
    kinds = gathered.tolist()
    if kinds[0] == REAL:
        return True
    if any(k == REAL for k in kinds[1:]):
        raise ShardingError(f"rank 0's model is on the meta device or deferred but ranks "
                            f"{[r for r, k in enumerate(kinds) if k == REAL]} hold real parameters: build the model "
                            "the same way on every rank, or real on rank 0 only (rank 0's values are scattered)")
    return False


class Materializer:
    """Produces full values for the parameters and buffers of one unit at a time."""

    def __init__(self, model: nn.Module, device: torch.device, param_init_fn):
        self.model, self.device, self.param_init_fn = model, device, param_init_fn
        self._initialized: set[int] = set()          # modules whose init already ran
        self._owner_modules: dict[int, list] = {}     # id(param) -> modules registering it
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None:
                    self._owner_modules.setdefault(id(p), []).append(m)
        self._hf = HFInit(model)   # transformers' own init rules, when the model is a PreTrainedModel

    def param_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Full real values for ``params`` (same order); meta modules are initialized on the way."""
        deferred = [p for p in params if tensor_kind(p) == DEFERRED]
        if deferred:
            values = _deferred.materialize([getattr(p, "_fp_float", p) for p in deferred], self.device)
            for p, v in zip(deferred, values):
                if getattr(p, "_fp_float", None) is not None:    # 4-bit: quantized whole, as eager .to() does
                    v = packed_quantize.quantize_whole(p, v)
                set_param_data(p, v)
        for p in params:
            if p.is_meta:
                for m in self._owner_modules[id(p)]:
                    self._init_module(m)
        return [p.data for p in params]

    def materialize_buffers(self, sites: list) -> None:
        """Make every buffer in ``sites`` (``(module, name)``) real, initializing meta modules once."""
        deferred = [(m, n) for m, n in sites if tensor_kind(m._buffers[n]) == DEFERRED]
        if deferred:
            values = _deferred.materialize([m._buffers[n] for m, n in deferred], self.device)
            for (m, n), v in zip(deferred, values):
                m._buffers[n] = v
        for m, n in sites:
            if m._buffers[n].is_meta:
                self._init_module(m)

    def close(self) -> None:
        """Called once every unit is built: drop the bookkeeping flags left on tensors."""
        self._hf.close()

    def _init_module(self, m: nn.Module) -> None:
        if id(m) in self._initialized:
            return
        self._initialized.add(id(m))
        own = [p for p in m._parameters.values() if p is not None and p.is_meta]
        bufs = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
        for p in own:
            set_param_data(p, torch.empty_like(p, device=self.device))
        for n in bufs:
            m._buffers[n] = torch.empty_like(m._buffers[n], device=self.device)
        fresh_bufs = [m._buffers[n] for n in bufs]
        with torch.no_grad():
            if self.param_init_fn == SKIP_INIT:
                self._skip_init(m, own, bufs)
            elif self.param_init_fn is not None:
                self.param_init_fn(m)
            elif self._hf.covers(m):
                self._hf_init(m, own + fresh_bufs)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
            else:
                self._refuse(m, own, bufs)
        if self._hf.active:
            for t in own + [m._buffers[n] for n in bufs]:
                self._hf.mark_done(t)

    def _hf_init(self, m: nn.Module, fresh: list) -> None:
        """transformers' own rules (``_init_weights``); a module they leave unset falls back to reset_parameters."""
        left = self._hf.run(m, fresh)
        if not left:
            return
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
            return
        names = [n for n, t in list(m._parameters.items()) + list(m._buffers.items()) if any(t is u for u in left)]
        raise ShardingError(
            f"module {type(m).__name__} (fields {names}) is on the meta device and neither transformers' "
            "_init_weights of its model nor a reset_parameters() initializes it: give ShardingConfig(param_init_fn=...) "
            "that initializes it, build the model under fp.deferred_init(), or build it on a real device")

    def _skip_init(self, m: nn.Module, own: list, bufs: list) -> None:
        """"skip": parameters and persistent buffers stay zero for a checkpoint to fill; non-persistent buffers
        are in no checkpoint, so they are computed (transformers' rules) or refused, never left zero."""
        for p in own:
            p.data.zero_()
        if self._hf.covers(m):
            for p in own:
                self._hf.mark_done(p)   # only the buffers are computed
            left = self._hf.run(m, [m._buffers[n] for n in bufs])
        else:
            left = [m._buffers[n] for n in bufs]
        missing = []
        for n in bufs:
            b = m._buffers[n]
            if any(b is u for u in left):
                b.zero_()
                if not is_persistent_buffer(m, n):
                    missing.append(n)
        if missing:
            raise ShardingError(
                f"module {type(m).__name__}: non-persistent buffer(s) {missing} are on the meta device and "
                "param_init_fn='skip' cannot fill them (no checkpoint holds them): keep buffers real when building "
                "(accelerate's init_empty_weights() does), build under fp.deferred_init(), or give "
                "param_init_fn=... that computes them")

    def _refuse(self, m: nn.Module, own: list, bufs: list) -> None:
        names = [n for n, p in m._parameters.items() if any(p is q for q in own)] + bufs
        raise ShardingError(
            f"module {type(m).__name__} (fields {names}) is on the meta device and has no reset_parameters(): "
            "give ShardingConfig(param_init_fn=...) that initializes it, build the model under "
            "fp.deferred_init() instead of torch.device('meta'), or build it on a real device")
