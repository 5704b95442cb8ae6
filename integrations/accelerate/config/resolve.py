"""Turn ``FsdpSettings`` into ``fp.ShardingConfig`` once the model is known.

Class names in ``fsdp_transformer_layer_cls_to_wrap`` are resolved on the model (as accelerate
does, by ``type(m).__name__``; absent names fall back to a Hugging Face model's
``_no_split_modules``), the ``fsdp_ignored_modules`` regex is full-matched against module names,
and ``mixed_precision`` becomes an ``fp.MixedPrecision`` with float32 reduction.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from .settings import FsdpSettings, WrapSpec, config_error

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sharding_kwargs(s: FsdpSettings, model: nn.Module, device: torch.device | None = None) -> dict[str, Any]:
    """``ShardingConfig`` keyword arguments for ``model`` (the engine validates them further)."""
    wrap = wrap_policy(s.wrap, model, s.key("wrap"))
    kwargs = {
        "sharding_strategy": s.strategy, "auto_wrap_policy": wrap, "mixed_precision": mixed_precision(s),
        "device_mesh": s.mesh, "backward_prefetch": s.backward_prefetch, "forward_prefetch": s.forward_prefetch,
        "limit_all_gathers": s.limit_all_gathers, "cpu_offload": s.cpu_offload,
        "activation_checkpointing": checkpoint_policy(s, wrap, model),
        "ignored_modules": ignored_modules(s.ignored_modules, model, s.key("ignored_modules")),
        "param_init_fn": s.param_init_fn, "some_ranks_modules": s.some_ranks_modules,
        "quantization": s.quantization, "expert_parallel": s.expert_parallel,
        "expert_capacity_factor": s.expert_capacity_factor,
        "context_parallel": s.context_parallel, "context_parallel_attention": s.context_parallel_attention,
    }
    if s.secondary_size is not None:
        kwargs["reshard_after_forward"] = s.secondary_size
    if device is not None:
        kwargs["device"] = device
    return kwargs


def sharding_config(s: FsdpSettings, model: nn.Module, device: torch.device | None = None):
    """An ``fp.ShardingConfig`` for ``model``."""
    import fsdp_plugin as fp

    return fp.ShardingConfig(**sharding_kwargs(s, model, device))


def class_by_name(model: nn.Module, name: str) -> type | None:
    """The class of the first submodule whose class is called ``name`` (accelerate's lookup)."""
    for module in model.modules():
        if type(module).__name__ == name:
            return type(module)
    return None


def wrap_policy(w: WrapSpec, model: nn.Module, key: str):
    """``WrapSpec`` → what ``ShardingConfig.auto_wrap_policy`` takes."""
    if w.kind == "default":
        return None
    if w.kind == "none":
        return _none_policy
    if w.kind == "size":
        import fsdp_plugin as fp

        return fp.size_policy(w.min_params)
    if w.kind == "callable":
        return w.fn
    if w.classes:
        return set(w.classes)
    names = w.class_names if w.class_names is not None else tuple(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise config_error(key, "TRANSFORMER_BASED_WRAP", "name the block classes in "
                           "fsdp_config.fsdp_transformer_layer_cls_to_wrap (the model has no _no_split_modules)")
    classes = {name: class_by_name(model, name) for name in names}
    missing = [n for n, c in classes.items() if c is None]
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise config_error("fsdp_config.fsdp_transformer_layer_cls_to_wrap", ",".join(names),
                           f"no module of class {missing} in the model; classes present: {present}")
    return set(classes.values())


def _none_policy(module: nn.Module) -> bool:
    """NO_WRAP: one root unit (accelerate's meaning), not the engine's repeated-block default."""
    return False


def checkpoint_policy(s: FsdpSettings, wrap, model: nn.Module):
    """``fsdp_activation_checkpointing: true`` → recompute the wrapped blocks; an ``fp.Checkpointing`` (plugin
    object) keeps its ``every``/``selective`` and, without ``modules``, recomputes the wrapped blocks too."""
    import dataclasses

    ac = s.activation_checkpointing
    if not ac:
        return None
    if isinstance(ac, bool):
        return _wrapped_blocks(s, wrap, model)
    return ac if ac.modules is not None else dataclasses.replace(ac, modules=_wrapped_blocks(s, wrap, model))


def _wrapped_blocks(s: FsdpSettings, wrap, model: nn.Module) -> set:
    if isinstance(wrap, set) and wrap:
        return set(wrap)
    names = tuple(getattr(model, "_no_split_modules", None) or ())
    classes = {c for c in (class_by_name(model, n) for n in names) if c is not None}
    if not classes:
        raise config_error(s.key("activation_checkpointing"), True, "activation checkpointing recomputes the "
                           "wrapped blocks: use fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP with "
                           "fsdp_transformer_layer_cls_to_wrap")
    return classes


def ignored_modules(value: Any, model: nn.Module, key: str) -> tuple:
    """A regex (full match on module names) or an iterable of modules → a tuple of modules."""
    if not value:
        return ()
    if isinstance(value, str):
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise config_error(key, value, f"not a valid regular expression ({exc})") from None
        found = tuple(m for name, m in model.named_modules() if name and pattern.fullmatch(name))
        if not found:
            raise config_error(key, value, "it matches no module name of the model")
        return found
    return tuple(value)


def mixed_precision(s: FsdpSettings):
    """``fp.MixedPrecision`` or None: low-precision params, float32 reduction (accelerate's flag)."""
    import fsdp_plugin as fp

    if s.param_dtype is not None or s.reduce_dtype is not None or s.buffer_dtype is not None:
        return fp.MixedPrecision(param_dtype=s.param_dtype, reduce_dtype=s.reduce_dtype, buffer_dtype=s.buffer_dtype,
                                 fp32_modules=s.fp32_modules)
    if s.mixed_precision == "no":
        return None
    return fp.MixedPrecision(param_dtype=_DTYPES[s.mixed_precision], reduce_dtype=torch.float32)
