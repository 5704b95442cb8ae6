"""Exceptions raised by fsdp_plugin. Every message says what to change."""


class FSDPPluginError(Exception):
    """Base class of every error fsdp_plugin raises on purpose."""


class ConfigError(FSDPPluginError, ValueError):
    """A ShardingConfig field (or an integration option translated into one) is invalid."""


class ShardingError(FSDPPluginError, RuntimeError):
    """The model cannot be sharded as asked (already sharded, uninitializable module, mixed dtypes...)."""


class OptimizerError(FSDPPluginError, RuntimeError):
    """An optimizer does not match the sharded parameters."""


class StateDictError(FSDPPluginError, RuntimeError):
    """A plain state_dict()/load_state_dict() was used where it would silently load shard pieces."""


class CollectiveError(FSDPPluginError, RuntimeError):
    """A collective failed or timed out; names the rank, the unit and the collective."""
