"""Activation checkpointing: whole-module, every k-th module, and torch's selective checkpointing.

The checkpoint wraps a module's ``forward``, not its ``__call__``: a unit's hooks (all-gather before forward,
reshard after) stay outside the recomputed region, and its backward all-gather (which precedes the
recomputation) refills the storage the recomputed ops read. Non-reentrant, as selective checkpointing needs.
Without early stop: torch stops a recomputation by raising through the modules still running, and a nested
unit's post-forward hook would then reshard that unit while the recomputed tensors alias its storage; the
whole forward is recomputed instead (torchtitan does the same), at the cost of the last ops of the module.
Shared with ``fp.plan``, whose fake run applies exactly this to measure the activation curve.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from ..config import Checkpointing, as_checkpointing
from ..errors import ConfigError
from .wrap import recompute_selector

_aten = torch.ops.aten
# What selective checkpointing keeps: the outputs of the expensive kernels (matmuls, convolutions, fused
# attention). Everything else -- norms, activations, softmax, dropout, adds, casts -- is recomputed, cheap
# per byte. Engine ops (views of all-gathered storage, collectives) are never kept: keeping a view of a
# unit's parameters would detach it from the parameter and drop that gradient.
_SAVE_NAMES = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution",
               "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
               "_efficient_attention_forward")
SAVED_OPS = frozenset(getattr(_aten, n) for n in _SAVE_NAMES if hasattr(_aten, n))


def apply_activation_checkpointing(model: nn.Module, policy, units: Iterable[nn.Module] = ()) -> int:
    """Make the modules ``policy`` selects recompute in backward; return how many were wrapped.

    ``policy`` is any form ``ShardingConfig.activation_checkpointing`` accepts; ``units`` are the non-root
    unit modules, which ``Checkpointing(modules=None)`` (and ``True``) selects.
    """
    ac = as_checkpointing(policy)
    if ac is None:
        return 0
    chosen = _selected(model, ac, list(units))
    for i, m in enumerate(chosen):
        if i % ac.every == 0:
            _wrap_forward(m, ac.selective)
    return len(range(0, len(chosen), ac.every))


def _selected(model: nn.Module, ac: Checkpointing, units: list) -> list:
    if ac.modules is None:
        if not units:
            raise ConfigError("activation_checkpointing=True (or Checkpointing(modules=None)) recomputes every "
                              "unit but the root, and this model has no other unit: name the modules, e.g. "
                              "fp.Checkpointing(modules={Block}), or choose units with auto_wrap_policy")
        ids = {id(u) for u in units}
        selected = lambda m: id(m) in ids  # noqa: E731
    else:
        selected = recompute_selector(model, ac.modules)
    return [m for m in model.modules() if m is not model and selected(m)]


def _wrap_forward(m: nn.Module, selective: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = m.forward
    extra = {"context_fn": selective_contexts} if selective else {}

    @functools.wraps(inner)
    def forward(*args, _inner=inner, **kwargs):
        if not torch.is_grad_enabled():
            return _inner(*args, **kwargs)
        return checkpoint(_inner, *args, use_reentrant=False, early_stop=False, **extra, **kwargs)
    m.forward = forward


def _policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(func, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The (forward, recompute) context pair of one selective checkpoint (a fresh cache per call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)
