"""The configurations the two-node benchmark compares: a table of ``fp.ShardingConfig`` keyword arguments.

Add one from the command line: ``run.py --extra 'mine={"sharding_strategy": "full_shard", ...}'``. The value
``"node"`` for ``reshard_after_forward`` becomes the ranks per node (hpZ inside the node) at run time, and a
``quantization`` dict becomes ``fp.Quantization(**dict)``.
"""
from __future__ import annotations

import dataclasses
import json

from fsdp_plugin import Quantization
from fsdp_plugin.planner import CANDIDATES, QUANTIZED_CANDIDATES, LayerSizes
from fsdp_plugin.planner._recommend import resolve as _resolve

# fp.planner's candidate tables (one owner: what `recommend` compares is what the testbed measures)
CONFIGURATIONS: dict[str, dict] = {**CANDIDATES, **QUANTIZED_CANDIDATES}
BASELINE = "hybrid_shard"      # paired ratios are step time / this configuration's, round by round


def preset_layer(cfg, batch: int) -> LayerSizes:
    """The layer `fp.planner.calibrate` times for a GPT preset (``_model.GPTConfig``) at ``batch`` sequences
    per rank: the model's own shapes (§ 35d: the default layer's matmuls ran 1.4x faster than the medium's)."""
    return LayerSizes(batch=batch, seq=cfg.seq_len, width=cfg.d_model, heads=cfg.n_head, vocab=cfg.vocab)


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


def spec_json(kwargs: dict) -> dict:
    """A table row as JSON (the worker stores it; `resolve` reads it back): ``fp.Quantization`` -> its dict."""
    return {k: dataclasses.asdict(v) if isinstance(v, Quantization) else v for k, v in kwargs.items()}
