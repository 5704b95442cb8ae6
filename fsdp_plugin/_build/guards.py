"""Guards against silent misuse of a sharded model: plain state_dict()/load_state_dict() (they would
see 1-D shard pieces) and optimizers whose state does not match the sharded parameters."""
from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn

from ..errors import OptimizerError, StateDictError

_STATE_DICT_HELP = ("on a sharded model outside `with fp.full_params(model):` it would hold 1-D shard pieces; "
                    "use fp.full_state_dict(model) (full tensors on rank 0), fp.save_checkpoint/fp.load_checkpoint "
                    "(sharded, any world size), or call it inside `with fp.full_params(model):`")
# Optimizers whose update of a parameter depends on more than its own elements (norms, factored
# moments, line searches): on 1-D shard pieces they compute per-shard statistics instead.
_NOT_ELEMENTWISE = {"LAMB", "Lamb", "FusedLAMB", "Adafactor", "LARS", "LBFGS", "Shampoo", "Muon", "SophiaG"}
_checked_optimizers: "weakref.WeakSet" = weakref.WeakSet()
_hook_handle = None


def install_guards(model: nn.Module, root) -> None:
    plain_state_dict, plain_load = model.state_dict, model.load_state_dict

    def state_dict(*args, **kwargs):
        if not root.full_params_active:
            raise StateDictError(f"{type(model).__name__}.state_dict(): {_STATE_DICT_HELP}")
        return plain_state_dict(*args, **kwargs)

    def load_state_dict(*args, **kwargs):
        if not root.full_params_active:
            raise StateDictError(f"{type(model).__name__}.load_state_dict(): {_STATE_DICT_HELP}")
        return plain_load(*args, **kwargs)

    model.state_dict = state_dict
    model.load_state_dict = load_state_dict
    _install_optimizer_check()


def _install_optimizer_check() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_check_optimizer)


def _check_optimizer(optimizer, args, kwargs) -> None:
    if optimizer in _checked_optimizers:
        return
    sharded = [p for g in optimizer.param_groups for p in g["params"] if getattr(p, "_fp_handle", None) is not None]
    if not sharded:
        return
    for p in sharded:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise OptimizerError(
                    f"{type(optimizer).__name__} state {key!r} has shape {tuple(value.shape)} but the sharded "
                    f"parameter is {tuple(p.shape)}: the optimizer stepped before fp.shard(). Build the optimizer "
                    "after fp.shard(model) from model.parameters(), or restore its state with fp.load_checkpoint")
    name = type(optimizer).__name__
    if name in _NOT_ELEMENTWISE:
        warnings.warn(f"{name} is not elementwise: its update uses whole-tensor statistics (norms, factored "
                      "moments), which on sharded 1-D pieces become per-shard statistics and differ from "
                      "unsharded training. Prefer an elementwise optimizer (SGD, Adam, AdamW, Lion).", stacklevel=3)
    _checked_optimizers.add(optimizer)
