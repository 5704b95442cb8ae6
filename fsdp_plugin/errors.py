"""Exceptions raised by fsdp_plugin. Every message says what to change.

Every class derives from :class:`FSDPPluginError` (``except fp.FSDPPluginError`` catches everything the
package raises on purpose) and keeps the builtin base a caller would expect (``ValueError`` for a bad
value, ``TypeError`` for a bad type...). Checkpoint errors live in :mod:`fsdp_plugin.checkpoint.errors`.
"""


class FSDPPluginError(Exception):
    """Base class of every error fsdp_plugin raises on purpose."""


class ConfigError(FSDPPluginError, ValueError):
    """A ShardingConfig field, an integration option or another argument value is invalid."""


class UsageError(FSDPPluginError, TypeError):
    """An argument of the wrong type, or arguments that cannot be combined."""


class UnsupportedError(FSDPPluginError, NotImplementedError):
    """A feature of a host library (Lightning, accelerate) that fsdp_plugin deliberately does not provide."""


class ShardingError(FSDPPluginError, RuntimeError):
    """The model cannot be sharded as asked (already sharded, uninitializable module, mixed dtypes...)."""


class OptimizerError(FSDPPluginError, RuntimeError):
    """An optimizer does not match the sharded parameters."""


class StateDictError(FSDPPluginError, RuntimeError):
    """A plain state_dict()/load_state_dict() was used where it would silently load shard pieces."""


class CollectiveError(FSDPPluginError, RuntimeError):
    """A collective failed or timed out; names the rank, the unit and the collective."""


class DeferredInitError(FSDPPluginError, RuntimeError):
    """``fp.deferred_init()`` cannot record or replay an operation (data-dependent shapes, foreign meta tensors)."""


class NotDeferredError(DeferredInitError, ValueError):
    """A tensor handed to deferred-init materialization was not recorded (or was already released)."""


class NonFiniteGradientError(FSDPPluginError, FloatingPointError, RuntimeError):
    """The total gradient norm is NaN or infinite and clipping was asked to raise (``error_if_nonfinite``)."""


class CodecError(FSDPPluginError, TypeError):
    """A value the pickle-free JSON + tensor codec (checkpoint extra, Lightning/accelerate state) cannot store."""


class TensorParallelError(ShardingError):
    """A tensor-parallel (DTensor) model fp.shard cannot shard as given: placement, mesh or wrapping."""
