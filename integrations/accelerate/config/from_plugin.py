"""Translate an ``accelerate.FullyShardedDataParallelPlugin`` object into ``FsdpSettings``.

The plugin's ``__post_init__`` has already parsed the user's values into torch FSDP enums, ``MixedPrecision``,
``CPUOffload`` and policy functions; those go through the integrations' one torch-FSDP translator
(:mod:`fsdp_plugin.integrations.accelerate.config.torch_fsdp_args`, shared with Lightning). Only accelerate's own meanings are
read here (``reshard_after_forward``, a bare transformer/size policy completed by
``transformer_cls_names_to_wrap``/``min_num_params``). Errors name the plugin field.
"""
from __future__ import annotations

import os
from typing import Any

import fsdp_plugin as fp
from fsdp_plugin.config import _SizePolicy
from fsdp_plugin.integrations.accelerate.config import torch_fsdp_args as torch_args

from . import parse as parse
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
    if _is_int(plugin.reshard_after_forward):     # FSDP2's int: hpZ's secondary group size, passed through
        s.secondary_size = int(plugin.reshard_after_forward)
    s.wrap = _plugin_wrap(plugin)
    args = torch_args.translate({
        "cpu_offload": plugin.cpu_offload, "mixed_precision": plugin.mixed_precision_policy,
        "backward_prefetch": plugin.backward_prefetch if plugin.fsdp_version == 1 else True}, _error)
    s.backward_prefetch, s.cpu_offload = args["backward_prefetch"], args["cpu_offload"]
    s.forward_prefetch = bool(plugin.forward_prefetch)
    s.limit_all_gathers = bool(plugin.limit_all_gathers) if plugin.limit_all_gathers is not None else True
    if plugin.activation_checkpointing_offload:
        raise config_error(_P + "activation_checkpointing_offload", True, "set it to False")
    ac = plugin.activation_checkpointing   # True, or an fp.Checkpointing (every k-th, selective) passed through
    s.activation_checkpointing = (torch_args.checkpoint_policy(ac, "activation_checkpointing", _error)
                                  if isinstance(ac, fp.Checkpointing) else bool(ac))
    s.ignored_modules = plugin.ignored_modules or None
    s.state_dict_type = parse.parse_state_dict_type(plugin.state_dict_type, _P + "state_dict_type")
    s.cpu_ram_efficient_loading = bool(plugin.cpu_ram_efficient_loading)
    s.sync_module_states = True if plugin.sync_module_states is None else bool(plugin.sync_module_states)
    if not plugin.sync_module_states:  # accelerate installs its own to_empty lambda when syncing
        s.param_init_fn = plugin.param_init_fn
    policy = args["mixed_precision"]
    if policy is not None:  # explicit dtypes (they override the mixed_precision flag)
        s.param_dtype, s.reduce_dtype, s.buffer_dtype = policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype
        s.fp32_modules = policy.fp32_modules
    s.some_ranks_modules = parse.some_ranks_from_env(os.environ)   # the plugin has no such field
    s.secondary_size = parse.hpz_from_env(os.environ) or s.secondary_size
    s.quantization = parse.quantization_from_env(os.environ)       # nor this one
    s.expert_parallel = parse.expert_parallel_from_env(os.environ)  # nor this one
    s.expert_capacity_factor = parse.expert_capacity_factor_from_env(os.environ)
    # a ParallelismConfig's cp_handler (selection.py) may set it again; without one, our variable alone
    s.context_parallel_attention = parse.context_parallel_attention(None, os.environ, "cp_comm_strategy")
    return s


#: torch-FSDP argument → the plugin field that carries it (for error messages).
_FIELDS = {"mixed_precision": "mixed_precision_policy"}


def _error(key: str, value: Any, why: str) -> Exception:
    return config_error(_P + _FIELDS.get(key, key), value, why)


def _plugin_strategy(plugin: Any) -> str:
    """``reshard_after_forward`` (bool or ShardingStrategy) wins over the deprecated ``sharding_strategy``."""
    reshard = plugin.reshard_after_forward
    if _is_int(reshard):          # hpZ keeps full_shard's sharding (the int is ShardingConfig's own meaning)
        return "full_shard"
    if reshard is not None:
        return parse.reshard_to_strategy(torch_args.enum_name(reshard), _P + "reshard_after_forward")
    if plugin.sharding_strategy is not None:
        return parse.strategy_from_name(plugin.sharding_strategy, _P + "sharding_strategy")
    return "full_shard"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plugin_wrap(plugin: Any) -> WrapSpec:
    """The plugin's policy: accelerate's bare transformer/size functions (completed by its class names or
    ``min_num_params``) here; every other torch policy through the shared translator."""
    policy = plugin.auto_wrap_policy
    if policy is None:  # NO_WRAP and "not set" look the same here: use the engine's block policy
        return WrapSpec(kind="default")
    name, kw = torch_args.policy_function(policy)
    if name == "transformer_auto_wrap_policy" and not kw.get("transformer_layer_cls"):
        names = plugin.transformer_cls_names_to_wrap
        return WrapSpec(kind="transformer", class_names=parse.split_names(names) if names else None)
    if name == "size_based_auto_wrap_policy" and "min_num_params" not in kw:
        n = plugin.min_num_params or 0
        return WrapSpec(kind="size", min_params=int(n)) if n else WrapSpec(kind="none")
    ours = torch_args.wrap_policy(policy, "auto_wrap_policy", _error)
    if isinstance(ours, (set, frozenset)):
        return WrapSpec(kind="transformer", classes=tuple(ours))
    if isinstance(ours, _SizePolicy):
        return WrapSpec(kind="size", min_params=ours.min_params)
    return WrapSpec(kind="callable", fn=ours)
