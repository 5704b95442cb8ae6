"""Which accelerate FSDP settings apply: ``fsdp_plugin=``, the launcher's env, or ``sharding_config=``.

Pops from the parent's bound arguments what stock accelerate must not see (the plugin, and a
``ParallelismConfig`` that we translate into a hybrid mesh).
"""
from __future__ import annotations

import os
from typing import Any

import accelerate

from .from_env import fsdp_requested, mesh_from_sizes, settings_from_env
from .from_plugin import settings_from_plugin
from .parse import context_parallel_attention, parse_mixed_precision
from .settings import FsdpSettings, config_error
from fsdp_plugin.errors import UsageError


def select_settings(bound: dict, sharding_config: Any) -> FsdpSettings | None:
    """Settings from ``fsdp_plugin=`` or the launcher env; pops what stock accelerate must not see."""
    plugin = bound.pop("fsdp_plugin", None)
    if plugin is not None and not isinstance(plugin, accelerate.utils.FullyShardedDataParallelPlugin):
        raise UsageError("`fsdp_plugin` must be an accelerate FullyShardedDataParallelPlugin")
    if sharding_config is not None:
        if plugin is not None:
            raise UsageError("pass either sharding_config= or fsdp_plugin=, not both")
        _reject_parallelism(bound)
        return None
    if plugin is not None:
        settings = settings_from_plugin(plugin)
    elif fsdp_requested():
        settings = settings_from_env()
    else:
        return None
    _apply_parallelism(settings, bound)
    return settings


_WHY_SP = "sequence parallelism (sp_size) is not supported: use cp_size (context parallel) for long sequences"


def _apply_parallelism(settings: FsdpSettings, bound: dict) -> None:
    """A ``ParallelismConfig`` (in code, or the launcher's when it asks for TP): dp_replicate/dp_shard alone →
    our hybrid mesh (stock accelerate never sees it); with tp_size > 1 it stays for stock accelerate, which
    builds and validates its device mesh and splits the data by dp rank (``accelerate/tensor_parallel.py``)."""
    pc = bound.get("parallelism_config")
    if pc is None and settings.tensor_parallel:     # from the launcher's env: accelerate's own parser reads it
        pc = bound["parallelism_config"] = accelerate.ParallelismConfig()
    if pc is None:
        return
    if (getattr(pc, "sp_size", 1) or 1) > 1:
        raise config_error("ParallelismConfig.sp_size", pc.sp_size, _WHY_SP)
    # cp_size is ours (fp.ShardingConfig.context_parallel): stock accelerate never sees it, else its own CP
    # (SDPA-only hooks, torch FSDP2) and the HF Trainer's batch sharding would run on top of ours
    settings.context_parallel = getattr(pc, "cp_size", 1) or 1
    if settings.context_parallel > 1:   # TorchContextParallelConfig(cp_comm_strategy=...): "alltoall" is a ring
        handler = getattr(pc, "cp_handler", None)
        settings.context_parallel_attention = context_parallel_attention(
            getattr(handler, "cp_comm_strategy", None), os.environ, "ParallelismConfig.cp_handler.cp_comm_strategy")
    settings.tensor_parallel = (pc.tp_size or 1) > 1
    # cp x tp: the ParallelismConfig stays for stock accelerate (its (dp.., cp, tp) mesh splits the data by dp
    # rank); the engine shards over a (dp.., cp) mesh of the same layout (accelerator.py, tensor_parallel.py)
    mesh, settings.strategy = mesh_from_sizes(pc.dp_replicate_size or 1,
                                              (pc.dp_shard_size or 1) * settings.context_parallel,
                                              settings.strategy, settings.key("strategy"))
    if settings.tensor_parallel:
        settings.mesh = None
    else:
        del bound["parallelism_config"]
        settings.mesh = mesh


def _reject_parallelism(bound: dict) -> None:
    """``sharding_config=`` carries its own mesh; a ParallelismConfig would be ambiguous."""
    if bound.get("parallelism_config") is not None:
        raise UsageError("pass either sharding_config= (with device_mesh) or parallelism_config=, not both")


def check_precision_flag(flag: Any) -> None:
    """Reject fp8 before accelerate tries to set it up."""
    value = flag if flag is not None else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    parse_mixed_precision(value, "mixed_precision")
