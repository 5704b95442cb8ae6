"""Optimizer state and step temporaries per rank, for the optimizers torch ships."""
from __future__ import annotations

from ..errors import ConfigError

# State tensors per parameter element (each in the parameter's dtype) and bytes read+written per element by
# one fp32 step, pass by pass as torch's implementations run them (for-loop and foreach alike): SGD
# param.add_(grad) 12; momentum buf.mul_().add_(grad) 20 + 12; Adam exp_avg.lerp_ 12, exp_avg_sq.mul_().addcmul_
# 20, denom = sqrt / bias correction + eps 24, param.addcdiv_ 16; AdamW adds param.mul_(1 - lr*wd) 8.
# Muon (fp.optim.Muon): buf.lerp_ 12, grad.lerp 12, bf16 cast 6, param.mul_ 8, param.add_(bf16) 10; its
# Newton–Schulz FLOPs and owner exchange are counted by _muon.py.
_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "muon": 1}
_STEP_TRAFFIC = {"sgd": 12, "sgd-momentum": 32, "adam": 72, "adamw": 80, "muon": 48}
OPTIMIZERS = tuple(_STATE)


def check(name: str) -> str:
    key = str(name).lower().replace("_", "-")
    key = {"momentum": "sgd-momentum", "sgdm": "sgd-momentum"}.get(key, key)
    if key not in _STATE:
        raise ConfigError(f"optimizer={name!r}: the planner knows {', '.join(OPTIMIZERS)}")
    return key


def state_bytes(name: str, trainable_shard_bytes: int) -> int:
    return _STATE[check(name)] * trainable_shard_bytes


def step_temporaries(name: str, trainable_shard_bytes: int, largest_piece_bytes: int, foreach: bool) -> int:
    """Adam(W) builds ``sqrt(exp_avg_sq)``: one tensor per parameter (for-loop: ~2 of the largest piece
    alive at once) or one list over all of them (foreach, torch's default on CUDA)."""
    if _STATE[check(name)] < 2:
        return 0
    return trainable_shard_bytes if foreach else 2 * largest_piece_bytes


def step_traffic(name: str, trainable_elems: int) -> int:
    return _STEP_TRAFFIC[check(name)] * trainable_elems


# The host step under cpu_offload: fp.shard gives torch's Adam/AdamW/SGD their fused CPU kernel (``_flat/offload.py``),
# one pass reading every operand once and writing the updated ones: SGD read p, g + write p 12; momentum + buf 20;
# Adam(W) read p, g, m, v + write p, m, v 28 (weight decay is inside the pass). Muon keeps its passes.
_FUSED_HOST_TRAFFIC = {"sgd": 12, "sgd-momentum": 20, "adam": 28, "adamw": 28, "muon": 48}


def host_step_traffic(name: str, trainable_elems: int) -> int:
    """Bytes one fused host optimizer step streams (fp32 masters) under cpu_offload."""
    return _FUSED_HOST_TRAFFIC[check(name)] * trainable_elems


def step_ops(name: str, n_tensors: int, foreach: bool) -> int:
    """Ops one step dispatches: about a dozen per parameter tensor (for-loop) or per group (foreach)."""
    per = {"sgd": 3, "sgd-momentum": 6, "adam": 12, "adamw": 12, "muon": 30}[check(name)]
    return per * (1 if foreach else n_tensors)
