"""Translate an ``accelerate.FullyShardedDataParallelPlugin`` object into ``FsdpSettings``.

The plugin's ``__post_init__`` has already normalized its fields into torch FSDP enums and policy
functions; we read them by name and attribute only (nothing here imports torch's FSDP package).
Errors name the plugin field.
"""
from __future__ import annotations

import functools
from typing import Any

from . import parse
from .settings import FsdpSettings, WrapSpec, config_error

_P = "FullyShardedDataParallelPlugin."


def settings_from_plugin(plugin: Any) -> FsdpSettings:
    """Read a ``FullyShardedDataParallelPlugin`` (any fsdp_version) into ``FsdpSettings``."""
    s = FsdpSettings(keys={f: _P + f for f in (
        "strategy", "wrap", "backward_prefetch", "forward_prefetch", "cpu_offload", "activation_checkpointing",
        "ignored_modules", "state_dict_type", "cpu_ram_efficient_loading", "sync_module_states")})
    s.keys["strategy"] = _P + "reshard_after_forward"
    s.keys["wrap"] = _P + "auto_wrap_policy"
    s.strategy = _plugin_strategy(plugin)
    s.wrap = _plugin_wrap(plugin)
    s.backward_prefetch = parse.parse_prefetch(plugin.backward_prefetch, _P + "backward_prefetch") \
        if plugin.fsdp_version == 1 else True
    s.forward_prefetch = bool(plugin.forward_prefetch)
    s.limit_all_gathers = bool(plugin.limit_all_gathers) if plugin.limit_all_gathers is not None else True
    s.cpu_offload = _offload(plugin.cpu_offload)
    if plugin.activation_checkpointing_offload:
        raise config_error(_P + "activation_checkpointing_offload", True, "set it to False")
    s.activation_checkpointing = bool(plugin.activation_checkpointing)
    s.ignored_modules = plugin.ignored_modules or None
    s.state_dict_type = parse.parse_state_dict_type(plugin.state_dict_type, _P + "state_dict_type")
    s.cpu_ram_efficient_loading = bool(plugin.cpu_ram_efficient_loading)
    s.sync_module_states = True if plugin.sync_module_states is None else bool(plugin.sync_module_states)
    if not plugin.sync_module_states:  # accelerate installs its own to_empty lambda when syncing
        s.param_init_fn = plugin.param_init_fn
    _read_policy(s, plugin.mixed_precision_policy)
    return s


def _plugin_strategy(plugin: Any) -> str:
    """``reshard_after_forward`` (bool or ShardingStrategy) wins over the deprecated ``sharding_strategy``."""
    reshard = plugin.reshard_after_forward
    if reshard is not None:
        return parse.reshard_to_strategy(parse.enum_name(reshard), _P + "reshard_after_forward")
    if plugin.sharding_strategy is not None:
        return parse.strategy_from_name(plugin.sharding_strategy, _P + "sharding_strategy")
    return "full_shard"


def _plugin_wrap(plugin: Any) -> WrapSpec:
    """Torch's policy functions (possibly ``functools.partial``) → ``WrapSpec``."""
    policy = plugin.auto_wrap_policy
    if policy is None:  # NO_WRAP and "not set" look the same here: use the engine's block policy
        return WrapSpec(kind="default")
    func = policy.func if isinstance(policy, functools.partial) else policy
    kw = policy.keywords if isinstance(policy, functools.partial) else {}
    name = getattr(func, "__name__", "")
    if name == "transformer_auto_wrap_policy":
        if "transformer_layer_cls" in kw:
            return WrapSpec(kind="transformer", classes=tuple(kw["transformer_layer_cls"]))
        names = plugin.transformer_cls_names_to_wrap
        return WrapSpec(kind="transformer", class_names=parse.split_names(names) if names else None)
    if name == "size_based_auto_wrap_policy":
        n = kw.get("min_num_params", plugin.min_num_params or 0)
        return WrapSpec(kind="size", min_params=int(n)) if n else WrapSpec(kind="none")
    if hasattr(policy, "_module_classes"):  # torch's ModuleWrapPolicy
        return WrapSpec(kind="transformer", classes=tuple(policy._module_classes))
    if callable(policy):
        return WrapSpec(kind="callable", fn=_torch_policy_adapter(policy))
    raise config_error(_P + "auto_wrap_policy", policy, "pass a set of module classes or a callable")


def _torch_policy_adapter(policy):
    """A torch-style ``policy(module, recurse, nonwrapped_numel)`` as our ``policy(module) -> bool``."""
    def wrap(module) -> bool:
        numel = sum(p.numel() for p in module.parameters())
        try:
            return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))
        except TypeError:
            return bool(policy(module))
    return wrap


def _offload(value: Any) -> bool:
    """``CPUOffload(offload_params=...)`` (v1) / ``CPUOffloadPolicy`` (v2) / bool → bool."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if hasattr(value, "offload_params"):
        return bool(value.offload_params)
    return type(value).__name__ == "CPUOffloadPolicy"


def _read_policy(s: FsdpSettings, policy: Any) -> None:
    """A torch ``MixedPrecision`` / ``MixedPrecisionPolicy`` → explicit dtypes."""
    if policy is None:
        return
    s.param_dtype = getattr(policy, "param_dtype", None)
    s.reduce_dtype = getattr(policy, "reduce_dtype", None)
    s.buffer_dtype = getattr(policy, "buffer_dtype", None)
