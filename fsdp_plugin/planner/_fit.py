"""`fit`: the smallest world size, and at that size the fastest strategy / activation checkpointing, whose
predicted peak per rank fits a memory budget."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from .._sizes import parse_size
from ..config import ShardingConfig
from ..errors import ConfigError
from ._capture import capture
from ._layer_sizes import LayerSizes
from ._result import Plan, fmt_bytes
from .api import _calibration, _default_inputs, plan_configs, split_options
from .errors import PlanError

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


def fit(model, memory, max_world: int = 1024, config: Optional[ShardingConfig] = None, **plan_kwargs) -> Fit:
    """Recommend (world size, strategy, activation checkpointing) for ``memory`` bytes per rank.

    Smallest world size first; at that size the fastest predicted step among the configurations that fit.
    ``config`` and ``plan_kwargs`` are `fp.plan`'s (wrap policy, optimizer, inputs, mixed precision,
    calibration...); the strategy and activation checkpointing are what `fit` chooses.
    """
    budget = parse_bytes(memory)
    module = capture(model)
    cfg, run = split_options(config, plan_kwargs)
    # context_parallel C / expert_parallel E: world sizes C or E divides (the only ones fp.shard accepts); EP
    # needs a shard group E divides, which no_shard's one-rank groups are not
    step = cfg.context_parallel * (cfg.expert_parallel or 1)
    worlds = [1 << k for k in range(max_world.bit_length()) if step <= (1 << k) <= max_world and (1 << k) % step == 0]
    if not worlds:
        raise PlanError(f"fit: no world size up to max_world={max_world} is a multiple of {step} "
                        "(context_parallel x expert_parallel): raise max_world")
    strategies = tuple(s for s in _PREFERENCE if not (s == "no_shard" and (cfg.expert_parallel or 1) > 1))
    if run["calibration"] == "calibrate":   # measure once, not once per configuration, at the model's shapes
        device = torch.device(run["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
        example = (run["inputs"] or _default_inputs(module, run["batch_size"], run["seq_len"]))()
        run["calibration"] = _calibration("calibrate", device, cfg.mixed_precision,
                                          LayerSizes.of(module, example, device))
    plans = {}
    for ac in (False, True):
        base = dataclasses.replace(cfg, activation_checkpointing=True if ac else None)
        cfgs = [dataclasses.replace(base, sharding_strategy=s) for s in strategies]
        for s, p in zip(strategies, plan_configs(module, worlds, cfgs, **run)):
            plans[(s, ac)] = p
    wrap = repr(cfg.auto_wrap_policy) if cfg.auto_wrap_policy else "default (repeated blocks)"
    for w in worlds:
        ok = [(p.worlds[w].step_s or 0.0, _PREFERENCE.index(s), ac, s, p) for (s, ac), p in plans.items()
              if p.worlds[w].peak <= budget]
        if ok:
            _, _, ac, s, p = min(ok)
            wp = p.worlds[w]
            keep = Plan(**{**p.__dict__, "worlds": {w: wp}})
            return Fit(budget, True, w, s, ac, wrap, wp.peak, wp.step_s, keep)
    return Fit(budget, False, None, None, None, wrap, None, None, None)
