"""The configurations the two-node benchmark compares: a table of ``fp.ShardingConfig`` keyword arguments.

Add one from the command line: ``run.py --extra 'mine={"sharding_strategy": "full_shard", ...}'``. The value
``"node"`` for ``reshard_after_forward`` becomes the ranks per node (hpZ inside the node) at run time, and a
``quantization`` dict becomes ``fp.Quantization(**dict)``.
"""
from __future__ import annotations

import json

from fsdp_plugin import Quantization
from fsdp_plugin.planner import CANDIDATES, QUANTIZED_CANDIDATES
from fsdp_plugin.planner._recommend import resolve as _resolve

# fp.planner's candidate tables (one owner: what `recommend` compares is what the testbed measures)
CONFIGURATIONS: dict[str, dict] = {**CANDIDATES, **QUANTIZED_CANDIDATES}
BASELINE = "hybrid_shard"      # paired ratios are step time / this configuration's, round by round


def parse_extra(items: list[str]) -> dict[str, dict]:
    """``name={json kwargs}`` strings -> extra table rows."""
    out = {}
    for item in items or ():
        name, _, kwargs = item.partition("=")
        out[name.strip()] = json.loads(kwargs)
    return out


def resolve(kwargs: dict, per_node: int) -> dict:
    """Run-time values (``fp.planner``'s rule: ``reshard_after_forward="node"`` -> the ranks per node), and a
    ``quantization`` dict from ``--extra`` -> ``fp.Quantization``."""
    kw = _resolve(kwargs, per_node)
    if isinstance(kw.get("quantization"), dict):
        kw["quantization"] = Quantization(**kw["quantization"])
    return kw
