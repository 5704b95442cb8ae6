"""Parsers for single accelerate FSDP values (strings from the env, enums or bools from a plugin).

Each parser takes the value and the user-facing key, and raises ``AccelerateConfigError`` naming
that key when the value is unsupported or malformed.
"""
from __future__ import annotations

from typing import Any

from fsdp_plugin.integrations.accelerate.config import torch_fsdp_args as torch_args

from .settings import config_error

enum_name = torch_args.enum_name

_V1_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_TRUE = ("true", "1", "yes", "y", "on", "t")
_FALSE = ("false", "0", "no", "n", "off", "f")


def parse_bool(value: Any, key: str) -> bool:
    """``true/false`` (any case, also 1/0, yes/no) or a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise config_error(key, value, "expected true or false")


def is_bool_text(value: Any) -> bool:
    """Whether ``value`` reads as a boolean (the v2 spelling of reshard_after_forward)."""
    return isinstance(value, bool) or str(value).strip().lower() in ("true", "false")


def strategy_from_name(value: Any, key: str) -> str:
    """A v1 strategy (name, digit 1-5 or torch ShardingStrategy) → our strategy name."""
    value = enum_name(value)
    text = str(value).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(_V1_NAMES):
        text = _V1_NAMES[int(text) - 1]  # accelerate's numbering of the config prompt
    ours = torch_args.sharding_strategy(text, key, lambda k, _, why: config_error(k, value, why))
    if ours not in torch_args.STRATEGY_NAMES.values():
        raise config_error(key, value, f"expected one of {', '.join(_V1_NAMES[:4])} or true/false")
    return ours


def reshard_to_strategy(value: Any, key: str) -> str:
    """``reshard_after_forward`` in either spelling: bool (v2) or a strategy name (v1)."""
    if is_bool_text(value):
        return "full_shard" if parse_bool(value, key) else "shard_grad_op"
    return strategy_from_name(value, key)


def parse_prefetch(value: Any, key: str) -> bool:
    """BACKWARD_PRE / BACKWARD_POST (or accelerate's digits 1, 2) → True, NO_PREFETCH (3) / None → False."""
    text = str(enum_name(value)).strip().upper() if value is not None else None
    if text is not None and text.isdigit():
        text = {"1": "BACKWARD_PRE", "2": "BACKWARD_POST", "3": "NO_PREFETCH"}.get(text, text)
    return torch_args.backward_prefetch(text, key, lambda k, _, why: config_error(
        k, value, "expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH"))


def parse_state_dict_type(value: Any, key: str) -> str:
    """SHARDED/LOCAL → "sharded" (our sharded format either way); FULL → "full"."""
    text = str(enum_name(value)).strip().upper()
    if text.isdigit():
        text = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}.get(text, text)
    if text == "FULL_STATE_DICT":
        return "full"
    if text in ("SHARDED_STATE_DICT", "LOCAL_STATE_DICT"):
        return "sharded"
    raise config_error(key, value, "expected FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT")


def parse_mixed_precision(value: Any, key: str) -> str:
    """Accelerate's mixed_precision flag → "no" | "bf16" | "fp16"."""
    text = str(enum_name(value) if value is not None else "no").strip().lower()
    if text in ("no", "none", "fp32", ""):
        return "no"
    if text in ("bf16", "fp16"):
        return text
    raise config_error(key, value, "use 'no', 'bf16' or 'fp16' (fp8 has no sharded path in fsdp_plugin)")


def parse_int(value: Any, key: str) -> int:
    """A non-negative integer."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise config_error(key, value, "expected an integer") from None
    if number < 0:
        raise config_error(key, value, "expected a non-negative integer")
    return number


def split_names(value: Any) -> tuple[str, ...]:
    """``"A, B"`` or a list of names → ``("A", "B")``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(v).strip() for v in items if str(v).strip())


QUANTIZATION_ENV = "FSDP_PLUGIN_QUANTIZATION"
_Q_NAMES = {"weights": "weights", "zero_quantized_weights": "weights",
            "gradients": "gradients", "zero_quantized_gradients": "gradients"}


def quantization_from_env(env):
    """``FSDP_PLUGIN_QUANTIZATION="weights,gradients"`` (either alone; DeepSpeed's ``zero_quantized_weights`` /
    ``zero_quantized_gradients`` as names too; a part may name its format, ``gradients=int4``; ``block_size=N``
    optional) → ``fp.Quantization`` (int8 for each part named without a format), or None (unset or empty).
    accelerate's FSDP config has no such key."""
    import fsdp_plugin as fp

    text = (env.get(QUANTIZATION_ENV) or "").strip()
    if not text:
        return None
    kwargs: dict = {}
    for item in split_names(text):
        name, _, value = item.partition("=")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "block_size" and value.isdigit():
            kwargs["block_size"] = int(value)
        elif name in _Q_NAMES:          # the format is fp.Quantization's to check
            kwargs[_Q_NAMES[name]] = value or "int8"
        else:
            raise config_error(QUANTIZATION_ENV, text, f"{item!r} is not 'weights', 'gradients' (=int8 or =int4) or "
                               "'block_size=N' (e.g. FSDP_PLUGIN_QUANTIZATION=weights,gradients)")
    if "weights" not in kwargs and "gradients" not in kwargs:
        raise config_error(QUANTIZATION_ENV, text, "name 'weights' and/or 'gradients' (block_size alone quantizes "
                           "nothing)")
    try:
        return fp.Quantization(**kwargs)
    except fp.ConfigError as e:
        raise config_error(QUANTIZATION_ENV, text, str(e)) from None


def zero_quantization(weights: bool, gradients: bool):
    """DeepSpeed's ``zero_quantized_weights`` / ``zero_quantized_gradients`` → ``fp.Quantization`` (int8 for
    each; DeepSpeed's int4 gradients become int8, whose error bound is proven) or None when both are off."""
    import fsdp_plugin as fp

    if not (weights or gradients):
        return None
    return fp.Quantization(weights="int8" if weights else None, gradients="int8" if gradients else None)


SOME_RANKS_ENV = "FSDP_PLUGIN_SOME_RANKS_MODULES"


def some_ranks_from_env(env) -> tuple[str, ...] | None:
    """``FSDP_PLUGIN_SOME_RANKS_MODULES="CLIPVisionModel,Qwen2VisionTransformerPretrainedModel"`` → the class
    names for ``ShardingConfig.some_ranks_modules`` (accelerate's config has no such key; the engine checks
    that each matches the model). ``none`` → ``()``: opt out of the default (a transformers VLM's encoders);
    unset or empty → None (the default)."""
    value = env.get(SOME_RANKS_ENV) or ""
    if value.strip().lower() == "none":
        return ()
    names = split_names(value)
    return names or None


HPZ_ENV = "FSDP_PLUGIN_HPZ_SIZE"


EXPERT_PARALLEL_ENV = "FSDP_PLUGIN_EXPERT_PARALLEL"


def expert_parallel_from_env(env) -> int | None:
    """``FSDP_PLUGIN_EXPERT_PARALLEL=2`` → ``ShardingConfig(expert_parallel=2)`` (issue 55): accelerate has no
    expert-parallel dimension (its ``ParallelismConfig`` has none), so this variable carries it."""
    text = (env.get(EXPERT_PARALLEL_ENV) or "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise config_error(EXPERT_PARALLEL_ENV, text, "expected the expert-parallel size E (ranks an MoE layer's "
                           "experts are split over), e.g. 2")
    return int(text)


EXPERT_CAPACITY_ENV = "FSDP_PLUGIN_EXPERT_CAPACITY_FACTOR"


def expert_capacity_factor_from_env(env) -> float | None:
    """``FSDP_PLUGIN_EXPERT_CAPACITY_FACTOR=1.25`` → ``ShardingConfig(expert_capacity_factor=1.25)`` (token
    dropping under expert parallelism, opt-in and inexact; unset: dropless)."""
    text = (env.get(EXPERT_CAPACITY_ENV) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise config_error(EXPERT_CAPACITY_ENV, text, "expected a positive capacity factor, e.g. 1.25 (unset: "
                           "dropless, exact)")
    return value


def hpz_from_env(env) -> int | None:
    """``FSDP_PLUGIN_HPZ_SIZE=8`` → ``ShardingConfig(reshard_after_forward=8)`` (hpZ; DeepSpeed's
    ``zero_hpz_partition_size``): accelerate's FSDP2 plugin accepts only a bool ``reshard_after_forward``."""
    text = (env.get(HPZ_ENV) or "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise config_error(HPZ_ENV, text, "expected the secondary group size (ranks per node), e.g. 8")
    return int(text)


CP_ATTENTION_ENV = "FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION"

#: accelerate's ``TorchContextParallelConfig.cp_comm_strategy`` → ``ShardingConfig.context_parallel_attention``.
#: torch's "allgather" gathers K/V, its "alltoall" rotates K/V blocks around the group (a ring, sent by all-to-all).
COMM_STRATEGY_MODES = {"allgather": "allgather", "alltoall": "ring"}


def context_parallel_attention(comm_strategy: Any, env, key: str) -> str:
    """The attention mode for CP from accelerate's comm strategy (``key`` names where it came from) and
    ``FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION`` (allgather | ring | ulysses: accelerate has no Ulysses mode, so
    this variable is the way to pick it). The variable wins over accelerate's default "allgather"; it may not
    contradict an explicit "alltoall"."""
    from fsdp_plugin.config import CP_ATTENTION

    strategy = "allgather" if comm_strategy is None else str(comm_strategy).strip().lower()
    if strategy not in COMM_STRATEGY_MODES:
        raise config_error(key, comm_strategy, "expected 'allgather' (K/V all-gathered) or 'alltoall' (K/V rotated "
                           f"around the group: our 'ring'); for Ulysses set {CP_ATTENTION_ENV}=ulysses")
    mode = COMM_STRATEGY_MODES[strategy]
    text = (env.get(CP_ATTENTION_ENV) or "").strip().lower()
    if not text:
        return mode
    if text not in CP_ATTENTION:
        raise config_error(CP_ATTENTION_ENV, text, f"expected one of {', '.join(CP_ATTENTION)}")
    if strategy == "alltoall" and text != "ring":
        raise config_error(CP_ATTENTION_ENV, text, f"{key} is 'alltoall' (our 'ring'): set one of them, or make "
                           f"them agree ({CP_ATTENTION_ENV}=ring)")
    return text
