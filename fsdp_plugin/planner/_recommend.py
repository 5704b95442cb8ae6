"""`fp.planner.recommend`: the fastest configuration that fits, across nodes joined by a link (``_links.py``)."""
from __future__ import annotations

from typing import Optional

from ..config import Quantization
from ._links import Links
from .api import plan_configs, split_options
from .errors import PlanError


# Candidates `recommend` compares: ShardingConfig keywords by name ("node": the ranks per node). Others are
# added by name, e.g. ``candidates={**CANDIDATES, **QUANTIZED_CANDIDATES}``.
CANDIDATES: dict = {
    "full_shard": dict(sharding_strategy="full_shard"),
    "shard_grad_op": dict(sharding_strategy="shard_grad_op"),
    "hybrid_shard": dict(sharding_strategy="hybrid_shard"),
    "hpz": dict(sharding_strategy="full_shard", reshard_after_forward="node"),
}


# The opt-in quantized options (ZeRO++; not exact: a different computation, so never recommended unless the
# caller passes them): ``recommend(..., candidates={**CANDIDATES, **QUANTIZED_CANDIDATES})``.
QUANTIZED_CANDIDATES: dict = {
    "hybrid_q8g": dict(sharding_strategy="hybrid_shard", quantization=Quantization(gradients="int8")),
    "zeropp": dict(sharding_strategy="full_shard", reshard_after_forward="node",
                   quantization=Quantization(weights="int8", gradients="int8")),
    "full_q8": dict(sharding_strategy="full_shard", quantization=Quantization(weights="int8", gradients="int8")),
}


def resolve(kwargs: dict, per_node: int) -> dict:
    kw = dict(kwargs)
    if kw.get("reshard_after_forward") == "node":
        kw["reshard_after_forward"] = per_node
    return kw


def recommend(model, world_size: int, nodes: int, link_gbps: float, candidates: Optional[dict] = None,
              memory_bytes: Optional[int] = None, **options) -> tuple:
    """(name of the fastest candidate that fits ``memory_bytes`` per rank, {name: Plan}) at ``world_size`` ranks
    on ``nodes`` nodes joined by ``link_gbps`` links; ``options``: `fp.plan`'s (inputs, optimizer, ...)."""
    k = Links.of(nodes, link_gbps, options.get("link_latency_us")).per_node(world_size)
    table = candidates or CANDIDATES
    cfgs, run = [], None
    for name, kw in table.items():
        cfg, run = split_options(None, {**options, **resolve(kw, k), "nodes": nodes, "link_gbps": link_gbps})
        cfgs.append(cfg)
    plans = dict(zip(table, plan_configs(model, world_size, cfgs, **run)))
    fits = {n: p for n, p in plans.items() if memory_bytes is None or p.worlds[world_size].peak <= memory_bytes}
    if not fits:
        raise PlanError(f"no candidate fits {memory_bytes:,} bytes per rank: "
                        + ", ".join(f"{n} {p.worlds[world_size].peak:,}" for n, p in plans.items()))
    best = min(fits, key=lambda n: fits[n].worlds[world_size].step_s or float("inf"))
    return best, plans
