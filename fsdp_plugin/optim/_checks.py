"""Argument checks of fp.optim.Muon: the same hyper-parameter rules as torch.optim.Muon, and parameters that
fit it (matrices of a sharded model), with errors that name the fix."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._flat.layout import param_info
from ..errors import OptimizerError

_ROUTE = ("route it to AdamW: Muon is for the 2-D hidden matrices; embeddings, the output head, norms, biases "
          "and scalars go to an elementwise optimizer (README, 'Matrix optimizers')")


def check_hyperparameters(lr, momentum: float, weight_decay: float, adjust_lr_fn) -> None:
    """torch.optim.Muon's own checks (ValueError, the same messages)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ["original", "match_rms_adamw"]:
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def check_params(param_groups: list) -> None:
    """Every parameter is a matrix (or a stack of them) by its *full* shape (raises OptimizerError naming the
    fix). Unsharded parameters are allowed here: Accelerate and Lightning may shard after the optimizer is
    built (identities survive fp.shard); :func:`check_managed` checks at each step."""
    for g in param_groups:
        for p in g["params"]:
            info = param_info(p)
            if len(info.shape) < 2:
                name = f"parameter {info.fqn!r}" if info.fqn else "a parameter"
                raise OptimizerError(f"fp.optim.Muon got {name} of shape {tuple(info.shape)}, not a matrix: {_ROUTE}")


def check_managed(params: list) -> None:
    """With more than one rank, every parameter stepped belongs to a model sharded by fp.shard: a plain tensor
    (a model never sharded, a copy, a full view from fp.full_params) would be orthogonalized per rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    for p in params:
        if getattr(p, "_fp_handle", None) is None:
            raise OptimizerError(
                f"fp.optim.Muon got a parameter of shape {tuple(p.shape)} that fp.shard does not manage (a model "
                "never sharded, a copy, or a view from fp.full_params): call fp.shard(model) before the first "
                "step and build the optimizer from model.parameters()")
