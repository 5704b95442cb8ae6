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

import torch
from torch import nn

from .. import _compat
from .._comm.stats import ring_bytes

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
    """Give every handle the local TP shapes of coordinate 0; returns the planned ``(module name, kind, style)``."""
    styles = _module_styles(model, tp_plan)
    local = {}
    for name, kind, _ in styles:
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
    """``[(module name, "colwise" | "rowwise" | "replicate", style)]`` of ``tp_plan`` (wildcards ``*`` expanded)."""
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
        out += [(n, kind, style) for n in hits]
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


# -- the TP dimension's bytes -----------------------------------------------------------------------------------
# A layout is "R" (Replicate), "P" (Partial) or ("S", dim). Forward of a redistribution A -> B, and backward of it
# given the layout the gradient arrives in (B, or "P" where the consumer is a colwise matmul of a replicated input).
def _fwd(a, b) -> Optional[str]:
    if a == b or (a == "R" and b != "P"):
        return None                   # same layout, or a local chunk of a replicated tensor
    if a == "P":
        return "all_reduce" if b == "R" else "reduce_scatter"
    if b == "R":
        return "all_gather"
    raise PlanError(f"a redistribution {a} -> {b} (all-to-all) is not modelled by fp.plan: measure it")


def _bwd(a, g) -> Optional[str]:
    if g == a or g == "R":
        return None
    if g == "P":
        return "all_reduce" if a == "R" else "reduce_scatter"
    return "all_gather"               # a sharded gradient to a replicated (or partial) input


def _layout(p, ndim: int):
    name = type(p).__name__
    if name == "Replicate":
        return "R"
    if name == "Partial":
        return "P"
    if name == "Shard":
        return ("S", p.dim % ndim if ndim else 0)
    raise PlanError(f"placement {p!r} in a tp_plan is not modelled by fp.plan: use Shard, Replicate or Partial")


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class Recorder:
    """Forward hooks on every planned module: per call, ``(kind, style, [(bytes, ndim, needs grad)] of the tensor
    inputs and of the outputs, [bytes] of its trainable parameters in the compute dtype, recomputed)``. A call
    during backward is activation checkpointing's recomputation: its forward collectives run again, its backward
    ones belong to the original call (and where recomputation stops early, the fake run's stops there too)."""

    def __init__(self, model: nn.Module, styles: list):
        self.calls, self._hooks = [], []
        for name, kind, style in styles:
            mod = model.get_submodule(name)
            self._hooks.append(mod.register_forward_hook(
                lambda m, args, out, kind=kind, style=style: self.calls.append(
                    (kind, style, isinstance(m, nn.Embedding), _io(args), _io(out),
                     [p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.requires_grad],
                     _compat.in_backward()))))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def wire(self, tp: int) -> tuple[dict, dict]:
        """(bytes, calls) per collective kind of one rank of the TP dimension for the recorded step."""
        nbytes: dict = {}
        calls: dict = {}
        for kind, style, emb, ins, outs, params, recomputed in self.calls:
            for op, size, phase in _module_ops(kind, style, emb, ins, outs, params):
                if recomputed and phase == "bwd":
                    continue
                nbytes[op] = nbytes.get(op, 0) + ring_bytes(size, 1, tp, 2 if op == "all_reduce" else 1)
                calls[op] = calls.get(op, 0) + 1
        return nbytes, calls


def _io(x) -> list:
    flat = x if isinstance(x, (tuple, list)) else (x,)
    return [(t.numel() * t.element_size(), t.dim(), t.requires_grad) for t in flat if isinstance(t, torch.Tensor)]


def _module_ops(kind: str, style, emb: bool, ins: list, outs: list, params: list) -> list:
    """``[(collective, full tensor bytes, "fwd" | "bwd")]`` one call of a planned module causes on the TP
    dimension (``emb``: the module is an ``nn.Embedding``)."""
    name = style if isinstance(style, str) else type(style).__name__
    ops: list = []

    def move(a, b, t, grad_partial=False):
        size, _, needs_grad = t
        ops.extend((op, size, phase) for op, phase in ((_fwd(a, b), "fwd"),
                                                       (_bwd(a, "P" if grad_partial else b) if needs_grad else None,
                                                        "bwd")) if op is not None)
    attr = (lambda k, d: d) if isinstance(style, str) else (lambda k, d: _first(getattr(style, k, None)) or d)
    if kind == "colwise" and ins and outs:
        given = "R" if emb or isinstance(style, str) else _layout(attr("input_layouts", None), ins[0][1])
        if not emb:      # the matmul of a sharded weight gives the replicated input a partial gradient
            move(given, "R", ins[0], grad_partial=True)
        want = "R" if name == "colwise_gather_output" else (
            ("S", outs[0][1] - 1) if isinstance(style, str) else _layout(attr("output_layouts", None), outs[0][1]))
        move(("S", outs[0][1] - 1), want, outs[0])
    elif kind == "rowwise" and outs:
        if ins and not emb:
            given = "R" if name == "rowwise_split_input" else (
                ("S", ins[0][1] - 1) if isinstance(style, str) else _layout(attr("input_layouts", None), ins[0][1]))
            move(given, ("S", ins[0][1] - 1), ins[0])
        want = "R" if isinstance(style, str) else _layout(attr("output_layouts", None), outs[0][1])
        move("P", want, outs[0])
    elif name in ("SequenceParallel", "sequence_parallel", "replicated_with_grad_allreduce"):
        # replicated parameters computed on sequence shards: their gradients are partial, all-reduced
        ops += [("all_reduce", n, "bwd") for n in params]
    elif name in ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"):
        pairs = []
        if hasattr(style, "desired_input_layouts"):
            pairs += [(a, b, t) for a, b, t in zip(style.input_layouts, style.desired_input_layouts, ins)]
        if hasattr(style, "desired_output_layouts"):
            pairs += [(a, b, t) for a, b, t in zip(style.output_layouts, style.desired_output_layouts, outs)]
        for a, b, t in pairs:
            if a is not None and b is not None:
                move(_layout(a, t[1]), _layout(b, t[1]), t)
    return ops
