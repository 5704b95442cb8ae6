"""fsdp_plugin: Fully Sharded Data Parallel training for PyTorch, as a plug-in for the trainers you use.

    import fsdp_plugin as fp
    model = fp.shard(model, fp.ShardingConfig(auto_wrap_policy={Block}))
    optimizer = torch.optim.AdamW(model.parameters())
"""
from . import _compat
_compat.check_torch()   # a torch outside the supported range: one clear ImportError here, naming the range
from . import planner  # noqa: F401 - fp.planner: fit, calibrate, parse_bytes
from ._log import configure_from_env as _configure_log
from .api import (clip_grad_norm_, comm_stats, compile, deferred_init, full_params, full_state_dict, is_sharded,
                  latest_checkpoint, load_checkpoint, load_pretrained, memory_report, no_sync, plan,
                  register_forward_method, reset, save_checkpoint, save_pretrained, shard, shutdown, sync_stats)
from .api import full_params_meta, iter_full_params, update_router_bias
from ._context.public import data_parallel_rank, data_parallel_size, gather_sequence
from .checkpoint import AsyncSave
from ._flat.layout import param_info
from . import optim
from .config import Checkpointing, MixedPrecision, Quantization, ShardingConfig, size_policy
from .grad_scaler import GradScaler
from ._schedule.eval_join import join
# every error class users may catch (docs/errors.md is the catalogue)
from .errors import (CodecError, CollectiveError, ConfigError, DeferredInitError, FSDPPluginError,
                     NonFiniteGradientError, NotDeferredError, OptimizerError, ShardingError, StateDictError,
                     TensorParallelError, UnsupportedError, UsageError)
from .checkpoint.errors import (CheckpointError, CheckpointMismatchError, CorruptCheckpointError,
                                IncompleteCheckpointError)
from .planner import Plan, PlanError

__version__ = "0.1.0"

__all__ = [
    "ShardingConfig", "MixedPrecision", "Quantization", "Checkpointing", "size_policy", "shard", "compile", "deferred_init", "no_sync", "full_params",
    "clip_grad_norm_", "full_state_dict", "param_info", "optim", "GradScaler", "is_sharded", "register_forward_method", "reset", "comm_stats", "sync_stats",
    "save_checkpoint", "AsyncSave", "load_checkpoint", "latest_checkpoint", "load_pretrained", "save_pretrained", "CheckpointError",
    "CheckpointMismatchError", "CorruptCheckpointError", "IncompleteCheckpointError",
    "shutdown",
    "iter_full_params", "full_params_meta",
    "data_parallel_rank", "data_parallel_size", "gather_sequence",
    "FSDPPluginError", "ConfigError", "ShardingError", "OptimizerError", "StateDictError", "CollectiveError",
    "plan", "Plan", "PlanError", "memory_report",
    "UsageError", "UnsupportedError", "DeferredInitError", "NotDeferredError", "NonFiniteGradientError", "CodecError",
    "TensorParallelError",
    "join", "update_router_bias",
]

_configure_log()

from .integrations.lightning._register import register_if_lightning_present as _register_lightning  # noqa: E402

_register_lightning()  # "fsdp_plugin" in Lightning's Trainer and Fabric registries; never imports Lightning itself
