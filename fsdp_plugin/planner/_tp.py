"""`fp.plan(..., tp_size=, tp_plan=)`: a tensor-parallel model planned from its plain form and its TP plan.

The planner never builds a DeviceMesh: each style of the plan is mapped to the placements torch's
``parallelize_module`` (or transformers' ``apply_tensor_parallelism``) gives the module's parameters, and each
planned flat buffer (``HandleSpec``) gets the *local* TP shapes of TP coordinate 0 (``Shard(d)`` of ``n`` rows:
``ceil(n / tp)``, torch's chunk rule, so coordinate 0 holds the most). The data-parallel part is then planned
exactly as ``fp.shard(model, device_mesh=mesh["dp"])`` shards those local tensors, over ``world // tp`` ranks:
shard, gradient and optimizer bytes, unsharded buffers and the dp collectives (``WorldPlan.wire_bytes``: what
``fp.comm_stats`` counts). Activations come from the fake run of the plain model, where TP-split activations
count whole: an upper bound.
"""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from .errors import PlanError

#: transformers' style names (``model.tp_plan``) -> the torch style they behave like for parameter placement.
_HF_STYLES = {"colwise": "colwise", "colwise_gather_output": "colwise", "rowwise": "rowwise",
              "rowwise_split_input": "rowwise", "embedding_rowwise": "rowwise", "sequence_parallel": "replicate",
              "replicated_with_grad_allreduce": "replicate"}
_TORCH_STYLES = {"ColwiseParallel": "colwise", "RowwiseParallel": "rowwise", "SequenceParallel": "replicate",
                 "PrepareModuleInput": "replicate", "PrepareModuleOutput": "replicate",
                 "PrepareModuleInputOutput": "replicate"}


def check(tp_size, tp_plan, worlds: list) -> int:
    """The TP degree (1: none), after checking it divides every world size and comes with a plan."""
    if tp_size is None or tp_size == 1:
        if tp_plan is not None:
            raise PlanError("fp.plan: tp_plan given without tp_size: pass tp_size=<tensor-parallel degree> too")
        return 1
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PlanError(f"tp_size={tp_size!r}: give the tensor-parallel degree, a positive int")
    bad = [w for w in worlds if w % tp_size]
    if bad:
        raise PlanError(f"tp_size={tp_size} does not divide world_size {bad}: the world is dp x tp ranks; give world "
                        "sizes that are multiples of tp_size")
    if tp_plan is None:
        raise PlanError(f"tp_size={tp_size} needs tp_plan: the dict you give parallelize_module ({{module name: "
                        "ColwiseParallel(), ...}}), or 'auto' for a transformers model's own tp_plan")
    return tp_size


def apply(model: nn.Module, handles: list, tp_size: int, tp_plan) -> list:
    """Give every handle the local TP shapes of coordinate 0; returns the planned (module name, kind) pairs."""
    styles = _module_styles(model, tp_plan)
    local = {}
    for name, kind in styles:
        mod = model.get_submodule(name)
        for pname, p in mod.named_parameters(recurse=False):
            dim = _shard_dim(mod, pname, kind)
            if dim is not None and p.dim() > dim:
                shape = list(p.shape)
                shape[dim] = -(-shape[dim] // tp_size)
                local[id(p)] = tuple(shape)
    for h in handles:
        h.shapes = [local.get(i, s) for i, s in zip(h.param_ids, h.shapes)]
        sizes = [_numel(s) for s in h.shapes]
        h.numel, h.largest = sum(sizes), max(sizes, default=0)
    return styles


def _shard_dim(mod: nn.Module, pname: str, kind: str) -> Optional[int]:
    """The dimension a style shards parameter ``pname`` of ``mod`` on (None: replicated), as torch places it."""
    if kind == "replicate":
        return None
    emb = isinstance(mod, nn.Embedding)
    if kind == "colwise":
        return (1 if emb else 0) if pname == "weight" else 0
    return (0 if emb else 1) if pname == "weight" else None   # rowwise: a Linear's bias stays Replicate


def _module_styles(model: nn.Module, tp_plan) -> list:
    """``[(module name, "colwise" | "rowwise" | "replicate")]`` of ``tp_plan`` (wildcards ``*`` expanded)."""
    if tp_plan == "auto":
        tp_plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
        if not tp_plan:
            raise PlanError(f"tp_plan='auto': {type(model).__name__} has no tp_plan; pass the dict you give "
                            "parallelize_module")
    if not isinstance(tp_plan, dict):
        raise PlanError(f"tp_plan={type(tp_plan).__name__}: give a dict {{module name: style}} or 'auto'")
    modules = dict(model.named_modules())
    out = []
    for pattern, style in tp_plan.items():
        kind = _kind(pattern, style)
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        hits = [n for n in modules if n and rx.match(n)]
        if not hits:
            raise PlanError(f"tp_plan key {pattern!r} matches no module of {type(model).__name__}: fix the plan "
                            "(names as in model.named_modules())")
        out += [(n, kind) for n in hits]
    return out


def _kind(pattern: str, style) -> str:
    name = style if isinstance(style, str) else type(style).__name__
    kind = _HF_STYLES.get(name) if isinstance(style, str) else _TORCH_STYLES.get(name)
    if kind is None:
        known = sorted(_HF_STYLES) if isinstance(style, str) else sorted(_TORCH_STYLES)
        raise PlanError(f"tp_plan[{pattern!r}] = {style!r}: fp.plan knows the styles {known}; plan the model with "
                        "those, or measure it (fp.comm_stats, fp.memory_report)")
    return kind


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
