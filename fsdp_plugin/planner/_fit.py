"""`fit`: the smallest world size, and at that size the fastest strategy / activation checkpointing, whose
predicted peak per rank fits a memory budget."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._sizes import parse_size
from ..errors import ConfigError
from ._capture import capture
from ._result import Plan, fmt_bytes
from .api import _calibration, _mixed_precision, plan_strategies
from .errors import PlanError

_PLAN_DEFAULTS = dict(auto_wrap_policy=None, optimizer="adamw", inputs=None, loss_fn=None, mixed_precision=None,
                      activation_checkpointing=None, cpu_offload=False, backward_prefetch=True,
                      forward_prefetch=False, limit_all_gathers=True, batch_size=1, seq_len=128, device=None,
                      calibration=None, gpus_per_node=8, ignored_modules=(), foreach=None)
_PREFERENCE = ("no_shard", "shard_grad_op", "full_shard")   # least communication first


def parse_bytes(text) -> int:
    """"80GB", "24GiB", "512MiB", "1e9" -> bytes (the checkpoint writer's parser: one rule for sizes)."""
    try:
        return parse_size(text)
    except (ConfigError, ValueError) as e:
        raise PlanError(f"memory {text!r}: write it like 80GB, 24GiB or 512MiB") from e


@dataclass
class Fit:
    memory: int
    fits: bool
    world_size: Optional[int]
    sharding_strategy: Optional[str]
    activation_checkpointing: Optional[bool]
    auto_wrap_policy: str
    peak_bytes: Optional[int]
    step_s: Optional[float]
    plan: Optional[Plan]

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "plan"}
        d["plan"] = self.plan.to_dict() if self.plan else None
        return d

    def __str__(self) -> str:
        if not self.fits:
            return f"nothing fits in {fmt_bytes(self.memory)} per rank up to the largest world size tried"
        return (f"fits {fmt_bytes(self.memory)} per rank: world size {self.world_size}, {self.sharding_strategy}, "
                f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}, units "
                f"{self.auto_wrap_policy} -> peak {fmt_bytes(self.peak_bytes)}"
                + (f", step {self.step_s * 1e3:.1f} ms" if self.step_s else "") + f"\n\n{self.plan}")


def fit(model, memory, max_world: int = 1024, **plan_kwargs) -> Fit:
    """Recommend (world size, strategy, activation checkpointing) for ``memory`` bytes per rank.

    Smallest world size first; at that size the fastest predicted step among the configurations that fit.
    ``plan_kwargs`` go to `fp.plan` (wrap policy, optimizer, inputs, mixed precision, calibration...).
    """
    budget = parse_bytes(memory)
    module = capture(model)
    worlds = [1 << k for k in range(max_world.bit_length()) if (1 << k) <= max_world]
    opts = {**_PLAN_DEFAULTS, **plan_kwargs}
    if opts["calibration"] == "calibrate":   # measure once, not once per configuration
        opts["calibration"] = _calibration("calibrate", torch.device(opts["device"] or (
            "cuda" if torch.cuda.is_available() else "cpu")), _mixed_precision(opts["mixed_precision"]))
    plans = {}
    for ac in (False, True):
        for s, p in zip(_PREFERENCE, plan_strategies(module, worlds, list(_PREFERENCE),
                                                      **{**opts, "activation_checkpointing": ac or None})):
            plans[(s, ac)] = p
    wrap = repr(plan_kwargs.get("auto_wrap_policy")) if plan_kwargs.get("auto_wrap_policy") else "default (repeated blocks)"
    for w in worlds:
        ok = [(p.worlds[w].step_s or 0.0, _PREFERENCE.index(s), ac, s, p) for (s, ac), p in plans.items()
              if p.worlds[w].peak <= budget]
        if ok:
            _, _, ac, s, p = min(ok)
            wp = p.worlds[w]
            keep = Plan(**{**p.__dict__, "worlds": {w: wp}})
            return Fit(budget, True, w, s, ac, wrap, wp.peak, wp.step_s, keep)
    return Fit(budget, False, None, None, None, wrap, None, None, None)
