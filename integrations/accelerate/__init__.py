"""Accelerate integration: ``from fsdp_plugin.integrations.accelerate import Accelerator``.

A drop-in ``accelerate.Accelerator`` whose FSDP (selected by an accelerate config with
``distributed_type: FSDP``, by ``fsdp_plugin=FullyShardedDataParallelPlugin(...)`` or by
``sharding_config=fp.ShardingConfig(...)``) runs on fsdp_plugin's engine, on CUDA and on CPU (gloo).
The config translators are importable without accelerate installed.
"""
from __future__ import annotations

from .config.from_env import settings_from_env
from .config.resolve import sharding_config, sharding_kwargs
from .config.settings import AccelerateConfigError, FsdpSettings

__all__ = [
    "AccelerateConfigError",
    "Accelerator",
    "FsdpSettings",
    "settings_from_env",
    "settings_from_plugin",
    "sharding_config",
    "sharding_kwargs",
]


def __getattr__(name: str):
    """Import the accelerate-dependent parts lazily."""
    if name == "Accelerator":
        from .accelerator import Accelerator

        return Accelerator
    if name == "settings_from_plugin":
        from .config.from_plugin import settings_from_plugin

        return settings_from_plugin
    raise AttributeError(name)
