"""Every public operation of fsdp_plugin, in one place (``import fsdp_plugin as fp`` re-exports them).

Each lives in the component that owns it; this module only names them:

    shard, deferred_init, compile           build a sharded model          (_build, _deferred)
    no_sync, full_params, full_state_dict,  use it                          (_ops)
    clip_grad_norm_, reset, is_sharded,
    register_forward_method
    save_checkpoint, load_checkpoint,       checkpoints and HF files        (checkpoint)
    save_pretrained, load_pretrained,
    latest_checkpoint                       resume after a restart          (checkpoint)
    iter_full_params, full_params_meta      stream full weights (RL sync)   (checkpoint)
    plan                                    predict memory, bytes, time     (planner)
    memory_report, comm_stats, sync_stats   observe it                      (_log, _comm)
    shutdown                                end the distributed run         (_groups)
    update_router_bias                      DeepSeek's router bias update   (_experts)
"""
from ._build.compile import compile
from ._build.shard import shard
from ._comm.collectives import STATS as comm_stats
from ._comm.collectives import SYNC as sync_stats
from ._deferred import deferred_init
from ._groups.shutdown import shutdown
from ._log import memory_report
from ._ops import (clip_grad_norm_, full_params, full_state_dict, is_sharded, no_sync, register_forward_method,
                   reset)
from .checkpoint import latest_checkpoint, load_checkpoint, load_pretrained, save_checkpoint, save_pretrained
from .checkpoint import full_params_meta, iter_full_params
from .planner import plan
from ._experts.router_bias import update as _update_router_bias

__all__ = ["shard", "deferred_init", "compile", "no_sync", "full_params", "full_state_dict", "clip_grad_norm_",
           "reset", "is_sharded", "register_forward_method", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "save_pretrained", "load_pretrained", "plan", "memory_report", "comm_stats", "sync_stats",
           "shutdown", "iter_full_params", "full_params_meta", "update_router_bias"]


def update_router_bias(model, rate: float = 1e-3) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing: after ``optimizer.step()``, move every router's
    ``e_score_correction_bias`` by ``rate * sign(mean_load - load_i)``, the loads (routes per expert since the last
    call, counted in backward) summed over every data-parallel rank, so the bias is the one one process computes
    on the global batch. Collective (every rank calls it). Returns ``{bias name: global loads}``."""
    return _update_router_bias(model, rate)
