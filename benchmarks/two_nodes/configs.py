"""The configurations the two-node benchmark compares: a table of ``fp.ShardingConfig`` keyword arguments.

Add one by name (e.g. quantized collectives: ``CONFIGURATIONS["qwz"] = dict(sharding_strategy="full_shard",
...)``) or from the command line: ``run.py --extra 'qwz={"sharding_strategy": "full_shard", ...}'``. The value
``"node"`` for ``reshard_after_forward`` becomes the ranks per node (hpZ inside the node) at run time, and a ``quantization`` dict becomes ``fp.Quantization(**dict)``.
"""
from __future__ import annotations

import json

CONFIGURATIONS: dict[str, dict] = {
    "full_shard": dict(sharding_strategy="full_shard"),
    "shard_grad_op": dict(sharding_strategy="shard_grad_op"),
    "hybrid_shard": dict(sharding_strategy="hybrid_shard"),
    "hpz": dict(sharding_strategy="full_shard", reshard_after_forward="node"),
    # ZeRO++ (issue 35 item 3): int8 gradients on hybrid's cross-node all-reduce; qwZ + hpZ + qgZ on full_shard.
    "hybrid_q8g": dict(sharding_strategy="hybrid_shard", quantization={"gradients": "int8"}),
    "zeropp": dict(sharding_strategy="full_shard", reshard_after_forward="node",
                   quantization={"weights": "int8", "gradients": "int8"}),
    "full_q8": dict(sharding_strategy="full_shard", quantization={"weights": "int8", "gradients": "int8"}),
}
BASELINE = "hybrid_shard"      # paired ratios are step time / this configuration's, round by round


def parse_extra(items: list[str]) -> dict[str, dict]:
    """``name={json kwargs}`` strings -> extra table rows."""
    out = {}
    for item in items or ():
        name, _, kwargs = item.partition("=")
        out[name.strip()] = json.loads(kwargs)
    return out


def resolve(kwargs: dict, per_node: int) -> dict:
    """Run-time values: ``reshard_after_forward="node"`` -> the ranks per node."""
    kw = dict(kwargs)
    if kw.get("reshard_after_forward") == "node":
        kw["reshard_after_forward"] = per_node
    if isinstance(kw.get("quantization"), dict):
        import fsdp_plugin as fp
        kw["quantization"] = fp.Quantization(**kw["quantization"])
    return kw
