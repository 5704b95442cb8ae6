"""transformers' own initialization for meta-device modules of a ``PreTrainedModel``.

transformers fills a model built on the meta device with ``PreTrainedModel.initialize_weights()``: every
module, children before parents, goes through the ``_init_weights`` of its nearest ``PreTrainedModel``
(composite models dispatch to each sub-model's rule). That is also how it computes the non-persistent
buffers no checkpoint holds (rotary ``inv_freq``, ``position_ids``, Gemma's ``embed_scale``, ...).

We do the same one module at a time, as the engine materializes a unit: for a freshly materialized module
we run ``_init_weights`` on it and then on each of its ancestors (a parent's rule may set its children, e.g.
GPT-2's scaled ``c_proj`` or T5's ``DenseActDense``), in transformers' guard
(``initialization.guard_torch_init_functions``). Every real tensor that is not being initialized carries
transformers' own ``_is_hf_initialized`` flag, which the guarded init functions honour, so nothing that
already holds values (rank 0's real weights, buffers accelerate kept real, earlier units) is overwritten.
The flags we set are removed by :meth:`HFInit.close`.
"""
from __future__ import annotations

import importlib
import itertools
import sys

import torch
from torch import nn

_FLAG = "_is_hf_initialized"


def _pretrained_class():
    mu = sys.modules.get("transformers.modeling_utils")   # never import transformers ourselves
    return getattr(mu, "PreTrainedModel", None)


def fill_unwritten(t: torch.Tensor) -> None:
    """Fill ``t`` with a value no initializer produces, so :func:`is_unwritten` can tell what was skipped."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def is_unwritten(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).any())


class HFInit:
    """Runs transformers' init rules for the modules of one model (inactive when it has no PreTrainedModel)."""

    def __init__(self, model: nn.Module):
        ptm = _pretrained_class()
        self._owner: dict[int, nn.Module | None] = {}
        self._parent: dict[int, nn.Module] = {}
        self._flagged: list[torch.Tensor] = []
        self.active = ptm is not None and any(isinstance(m, ptm) for m in model.modules())
        if not self.active:
            return
        self._guard = importlib.import_module("transformers.initialization").guard_torch_init_functions
        self._index(model, None, ptm)
        for t in itertools.chain(model.parameters(), model.buffers()):
            if not t.is_meta:
                self.mark_done(t)

    def _index(self, model: nn.Module, owner, ptm) -> None:
        stack = [(model, owner)]
        while stack:
            m, owner = stack.pop()
            owner = m if isinstance(m, ptm) else owner
            self._owner[id(m)] = owner
            for child in m.children():
                if id(child) not in self._owner:
                    self._parent[id(child)] = m
                    stack.append((child, owner))

    def covers(self, m: nn.Module) -> bool:
        """True when ``m`` lies inside a ``PreTrainedModel`` (its rules apply)."""
        return self.active and self._owner.get(id(m)) is not None

    def mark_done(self, t: torch.Tensor) -> None:
        """Protect ``t``'s values from the init rules (transformers' own flag)."""
        if not getattr(t, _FLAG, False):
            setattr(t, _FLAG, True)
            self._flagged.append(t)

    def run(self, m: nn.Module, fresh: list[torch.Tensor]) -> list[torch.Tensor]:
        """Initialize ``fresh`` (``m``'s just-materialized tensors) by the model's rules; return those left unset."""
        with torch.no_grad():
            for t in fresh:
                fill_unwritten(t)
            with self._guard():
                cur = m
                while cur is not None:
                    owner = self._owner.get(id(cur))
                    if owner is not None:
                        owner._init_weights(cur)
                    cur = self._parent.get(id(cur))
            left = [t for t in fresh if is_unwritten(t)]
        for t in fresh:
            if not any(t is u for u in left):
                self.mark_done(t)
        return left

    def close(self) -> None:
        """Remove the flags this object set (the model is left as transformers would see it)."""
        for t in self._flagged:
            try:
                delattr(t, _FLAG)
            except AttributeError:
                pass
        self._flagged.clear()


def retie(model: nn.Module) -> None:
    """Restore a transformers model's tied weights before its parameters are collected.

    accelerate's ``init_empty_weights()`` re-creates every parameter as it is registered, which undoes the
    ties transformers made in ``__init__`` (T5's embedding shared by both stacks, tied LM heads);
    ``from_pretrained`` re-ties after loading with ``tie_weights()``, and so do we, for meta-built models only.
    """
    ptm = _pretrained_class()
    if ptm is not None and isinstance(model, ptm) and any(p.is_meta for p in model.parameters()):
        model.tie_weights()
