"""Translate the environment ``accelerate launch`` exports for an FSDP config into ``FsdpSettings``.

``accelerate launch`` turns the yaml's ``fsdp_config:`` keys into ``FSDP_*`` variables (always, with
CLI defaults for absent keys, except where noted in the research notes), the top-level
``mixed_precision`` into ``ACCELERATE_MIXED_PRECISION`` and ``parallelism_config:`` into
``PARALLELISM_CONFIG_*``. Errors name the yaml key.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from . import parse as parse
from .settings import FsdpSettings, WrapSpec, config_error

_YAML = {
    "VERSION": "fsdp_version", "SHARDING_STRATEGY": "fsdp_sharding_strategy",
    "RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward", "OFFLOAD_PARAMS": "fsdp_offload_params",
    "MIN_NUM_PARAMS": "fsdp_min_num_params", "AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
    "TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    "BACKWARD_PREFETCH": "fsdp_backward_prefetch", "STATE_DICT_TYPE": "fsdp_state_dict_type",
    "FORWARD_PREFETCH": "fsdp_forward_prefetch", "USE_ORIG_PARAMS": "fsdp_use_orig_params",
    "CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
    "SYNC_MODULE_STATES": "fsdp_sync_module_states",
    "ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing",
    "ACTIVATION_CHECKPOINTING_OFFLOAD": "fsdp_activation_checkpointing_offload",
    "IGNORED_MODULES": "fsdp_ignored_modules",
}


def yaml_key(suffix: str) -> str:
    """``"OFFLOAD_PARAMS"`` → ``"fsdp_config.fsdp_offload_params"`` (the key users write)."""
    return f"fsdp_config.{_YAML[suffix]}"


def fsdp_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher selected FSDP (``distributed_type: FSDP``)."""
    env = os.environ if env is None else env
    return str(env.get("ACCELERATE_USE_FSDP", "false")).lower() == "true"


def settings_from_env(env: Mapping[str, str] | None = None) -> FsdpSettings:
    """Read ``FSDP_*``, ``ACCELERATE_MIXED_PRECISION`` and ``PARALLELISM_CONFIG_*`` into settings."""
    env = dict(os.environ if env is None else env)
    get = lambda suffix: env.get("FSDP_" + suffix)
    s = FsdpSettings(keys={name: yaml_key(sfx) for name, sfx in _FIELD_KEYS.items()})
    s.keys["mixed_precision"] = "mixed_precision"
    s.strategy = _strategy(get("VERSION"), get("RESHARD_AFTER_FORWARD"), get("SHARDING_STRATEGY"))
    s.wrap = _wrap(get("AUTO_WRAP_POLICY"), get("TRANSFORMER_CLS_TO_WRAP"), get("MIN_NUM_PARAMS"))
    _read_flags(s, get)
    s.mixed_precision = parse.parse_mixed_precision(env.get("ACCELERATE_MIXED_PRECISION", "no"), "mixed_precision")
    s.mesh, s.strategy = mesh_from_parallelism(env, s.strategy, s.key("strategy"))
    s.tensor_parallel = tensor_parallel_requested(env)
    s.context_parallel = context_parallel_from_env(env)
    s.context_parallel_attention = context_parallel_attention_from_env(env)
    s.some_ranks_modules = parse.some_ranks_from_env(env)
    s.secondary_size = parse.hpz_from_env(env) or s.secondary_size
    s.keys["some_ranks_modules"] = parse.SOME_RANKS_ENV
    s.quantization = parse.quantization_from_env(env)
    s.expert_parallel = parse.expert_parallel_from_env(env)
    s.expert_capacity_factor = parse.expert_capacity_factor_from_env(env)
    return s


_FIELD_KEYS = {
    "strategy": "RESHARD_AFTER_FORWARD", "wrap": "AUTO_WRAP_POLICY", "backward_prefetch": "BACKWARD_PREFETCH",
    "forward_prefetch": "FORWARD_PREFETCH", "cpu_offload": "OFFLOAD_PARAMS",
    "activation_checkpointing": "ACTIVATION_CHECKPOINTING", "ignored_modules": "IGNORED_MODULES",
    "state_dict_type": "STATE_DICT_TYPE", "cpu_ram_efficient_loading": "CPU_RAM_EFFICIENT_LOADING",
    "sync_module_states": "SYNC_MODULE_STATES",
}


def _read_flags(s: FsdpSettings, get) -> None:
    """The boolean and simple enum keys."""
    flags = {"cpu_offload": "OFFLOAD_PARAMS", "forward_prefetch": "FORWARD_PREFETCH",
             "activation_checkpointing": "ACTIVATION_CHECKPOINTING",
             "cpu_ram_efficient_loading": "CPU_RAM_EFFICIENT_LOADING", "sync_module_states": "SYNC_MODULE_STATES"}
    for name, sfx in flags.items():
        if get(sfx) is not None:
            setattr(s, name, parse.parse_bool(get(sfx), yaml_key(sfx)))
    if get("ACTIVATION_CHECKPOINTING_OFFLOAD") is not None and parse.parse_bool(
            get("ACTIVATION_CHECKPOINTING_OFFLOAD"), yaml_key("ACTIVATION_CHECKPOINTING_OFFLOAD")):
        raise config_error(yaml_key("ACTIVATION_CHECKPOINTING_OFFLOAD"), True,
                           "set it to false (activation checkpointing itself is supported)")
    if get("USE_ORIG_PARAMS") is not None:
        parse.parse_bool(get("USE_ORIG_PARAMS"), yaml_key("USE_ORIG_PARAMS"))  # validated; identity always kept
    if get("BACKWARD_PREFETCH") is not None:
        s.backward_prefetch = parse.parse_prefetch(get("BACKWARD_PREFETCH"), yaml_key("BACKWARD_PREFETCH"))
    if get("STATE_DICT_TYPE") is not None:
        s.state_dict_type = parse.parse_state_dict_type(get("STATE_DICT_TYPE"), yaml_key("STATE_DICT_TYPE"))
    if get("IGNORED_MODULES"):
        s.ignored_modules = get("IGNORED_MODULES")


def _strategy(version: str | None, reshard: str | None, legacy: str | None) -> str:
    """Pick the strategy; a v1 config's ``fsdp_reshard_after_forward`` wins over the launcher's default.

    ``accelerate launch`` always exports ``FSDP_SHARDING_STRATEGY=FULL_SHARD`` and, even for v1,
    ``FSDP_RESHARD_AFTER_FORWARD=true`` when the keys are absent. A strategy *name* in
    ``fsdp_reshard_after_forward`` is therefore always the user's choice; ``true`` may be the leaked
    default, so for v1 it defers to an explicitly non-default ``fsdp_sharding_strategy``.
    """
    r_key, l_key = yaml_key("RESHARD_AFTER_FORWARD"), yaml_key("SHARDING_STRATEGY")
    if version is not None and str(version).strip() not in ("1", "2"):
        raise config_error(yaml_key("VERSION"), version, "expected 1 or 2")
    legacy_strategy = parse.strategy_from_name(legacy, l_key) if legacy else "full_shard"
    if reshard is None or str(reshard).strip() == "":
        return legacy_strategy if str(version or "1").strip() == "1" else "full_shard"
    chosen = parse.reshard_to_strategy(reshard, r_key)
    if str(version or "1").strip() == "2":
        return chosen
    if parse.is_bool_text(reshard) and parse.parse_bool(reshard, r_key):
        return legacy_strategy  # "true": the launcher's default or full_shard; the legacy key may refine it
    if legacy_strategy != "full_shard" and legacy_strategy != chosen:
        raise config_error(r_key, reshard, f"it disagrees with {l_key}={legacy!r}; keep only one of the two keys")
    return chosen


def _wrap(policy: str | None, class_names: str | None, min_params: str | None) -> WrapSpec:
    """``fsdp_auto_wrap_policy`` (+ class names or min params) → ``WrapSpec``."""
    if policy is None or str(policy).strip() == "":
        return WrapSpec(kind="default")
    text = str(policy).strip().upper()
    if text == "TRANSFORMER_BASED_WRAP":
        names = parse.split_names(class_names) if class_names else None
        return WrapSpec(kind="transformer", class_names=names)
    if text == "SIZE_BASED_WRAP":
        n = parse.parse_int(min_params if min_params is not None else 0, yaml_key("MIN_NUM_PARAMS"))
        return WrapSpec(kind="size", min_params=n) if n > 0 else WrapSpec(kind="none")
    if text == "NO_WRAP":
        return WrapSpec(kind="none")
    raise config_error(yaml_key("AUTO_WRAP_POLICY"), policy,
                       "expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP")


_PC = "parallelism_config.parallelism_config_"


def mesh_from_parallelism(env: Mapping[str, str], strategy: str, strategy_key: str):
    """``PARALLELISM_CONFIG_*`` → ``(mesh, strategy)``: replicate > 1 means hybrid_shard. With a TP size > 1 the
    mesh is None: accelerate's own ``ParallelismConfig`` (which reads these variables) builds it, see
    :func:`tensor_parallel_requested`."""
    if str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() != "true":
        return None, strategy
    size = parse.parse_int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1"), f"{_PC}sp_size")
    if size > 1:
        raise config_error(f"{_PC}sp_size", size, "only data, context and tensor parallelism "
                           "(dp_replicate/dp_shard/cp/tp): use cp_size for long sequences")
    cp = context_parallel_from_env(env)
    rep = parse.parse_int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"), f"{_PC}dp_replicate_size")
    shard = parse.parse_int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1"), f"{_PC}dp_shard_size")
    # parameters shard over dp_shard x cp (accelerate's own flattened "dp_shard_cp")
    mesh, strategy = mesh_from_sizes(rep, max(shard, 1) * cp, strategy, strategy_key)
    return (None if tensor_parallel_requested(env) else mesh), strategy


def context_parallel_from_env(env: Mapping[str, str]) -> int:
    """The launcher's ``parallelism_config_cp_size`` (1 unless the parallelism config is on)."""
    if str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() != "true":
        return 1
    return parse.parse_int(env.get("PARALLELISM_CONFIG_CP_SIZE", "1"), f"{_PC}cp_size")


def context_parallel_attention_from_env(env: Mapping[str, str]) -> str:
    """The launcher's ``parallelism_config_cp_comm_strategy`` (exported only with cp_size > 1) mapped onto our
    mode, or ``FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION`` (see ``parse.context_parallel_attention``)."""
    on = str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() == "true"
    strategy = env.get("PARALLELISM_CONFIG_CP_COMM_STRATEGY") if on else None
    return parse.context_parallel_attention(strategy, env, f"{_PC}cp_comm_strategy")


def tensor_parallel_requested(env: Mapping[str, str]) -> bool:
    """Whether the launcher's ``parallelism_config`` asks for a TP size > 1."""
    if str(env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false")).lower() != "true":
        return False
    return parse.parse_int(env.get("PARALLELISM_CONFIG_TP_SIZE", "1"), f"{_PC}tp_size") > 1


def mesh_from_sizes(rep: int, shard: int, strategy: str, strategy_key: str):
    """(dp_replicate, dp_shard) → ``(mesh, strategy)``."""
    if rep <= 1:
        return None, strategy
    if strategy not in ("full_shard", "hybrid_shard"):
        raise config_error(strategy_key, strategy, "dp_replicate_size > 1 (hybrid) needs resharding after "
                           "forward: set fsdp_reshard_after_forward to true")
    return (rep, max(shard, 1)), "hybrid_shard"
