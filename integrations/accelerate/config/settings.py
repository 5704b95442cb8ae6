"""The engine-neutral view of an Accelerate FSDP configuration.

``FsdpSettings`` holds what an accelerate config (yaml → ``FSDP_*`` env) or a
``FullyShardedDataParallelPlugin`` asks for, as plain values. ``resolve.py`` turns it into
``fp.ShardingConfig`` keyword arguments once the model is known (class names → classes,
regexes → modules). Every value remembers the user-facing key it came from so that an
unsupported value fails with an error naming that key.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_plugin.errors import ConfigError


class AccelerateConfigError(ConfigError):
    """An accelerate FSDP setting that fsdp_plugin cannot honour; the message names the key."""


def config_error(key: str, value: Any, why: str) -> AccelerateConfigError:
    """Build the error for ``key: value`` with an explanation of what to change."""
    return AccelerateConfigError(f"{key}: {value!r} is not supported by fsdp_plugin: {why}")


@dataclass
class WrapSpec:
    """Auto-wrap request: ``kind`` is "default" (the engine's repeated-block policy), "none" (NO_WRAP:
    one root unit), "transformer", "size" or "callable"."""

    kind: str = "default"
    class_names: tuple[str, ...] | None = None  # transformer: None = the model's _no_split_modules
    classes: tuple[type, ...] = ()               # transformer: classes given directly (plugin path)
    min_params: int = 0                          # size
    fn: Callable | None = None                   # callable(module) -> bool


@dataclass
class FsdpSettings:
    """What the user configured, before the model is known. ``keys`` maps field → source key."""

    strategy: str = "full_shard"
    wrap: WrapSpec = field(default_factory=WrapSpec)
    backward_prefetch: bool = True
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    cpu_offload: bool = False
    activation_checkpointing: Any = False  # bool, or an fp.Checkpointing from a plugin object
    ignored_modules: Any = None        # None | regex str | iterable of modules
    mixed_precision: str = "no"        # "no" | "bf16" | "fp16"
    param_dtype: Any = None            # explicit policy from a plugin (overrides mixed_precision dtypes)
    reduce_dtype: Any = None
    buffer_dtype: Any = None
    fp32_modules: tuple = ()           # fp.MixedPrecision.fp32_modules (FSDP1's _module_classes_to_ignore)
    mesh: tuple[int, int] | None = None  # hybrid (replicate, shard); None = derived at resolve time
    tensor_parallel: bool = False      # ParallelismConfig tp_size > 1: accelerate's mesh, fp.shard over its dp dims
    state_dict_type: str = "sharded"   # "sharded" | "full"
    cpu_ram_efficient_loading: bool = False
    sync_module_states: bool = True
    param_init_fn: Callable | None = None
    some_ranks_modules: tuple[str, ...] | None = None   # class names (FSDP_PLUGIN_SOME_RANKS_MODULES)
    secondary_size: int | None = None  # hpZ: the plugin's reshard_after_forward=<int> (fp: the same int)
    quantization: Any = None           # fp.Quantization | None (FSDP_PLUGIN_QUANTIZATION)
    expert_parallel: int | None = None  # ShardingConfig.expert_parallel (FSDP_PLUGIN_EXPERT_PARALLEL)
    expert_capacity_factor: float | None = None  # ShardingConfig's (FSDP_PLUGIN_EXPERT_CAPACITY_FACTOR)
    context_parallel: int = 1          # ParallelismConfig cp_size (fp.ShardingConfig.context_parallel)
    context_parallel_attention: str = "allgather"  # cp_handler.cp_comm_strategy / FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION
    keys: dict[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        """The user-facing key that set ``name`` (for error messages)."""
        return self.keys.get(name, name)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary, echoed by scripts and tests."""
        wrap = self.wrap
        names = list(wrap.class_names or [c.__name__ for c in wrap.classes])
        wrap_desc = {"default": "default", "none": "NO_WRAP", "transformer": names,
                     "size": f"min_params={wrap.min_params}", "callable": "callable"}[wrap.kind]
        return {
            "sharding_strategy": self.strategy, "auto_wrap": wrap_desc, "mesh": self.mesh,
            "tensor_parallel": self.tensor_parallel,
            "mixed_precision": self.mixed_precision, "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch, "cpu_offload": self.cpu_offload,
            "activation_checkpointing": self.activation_checkpointing if isinstance(
                self.activation_checkpointing, bool) else repr(self.activation_checkpointing),
            "state_dict_type": self.state_dict_type,
            "cpu_ram_efficient_loading": self.cpu_ram_efficient_loading,
        }
