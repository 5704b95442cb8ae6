"""DeepSeek-V3's auxiliary-loss-free balancing: the router's ``e_score_correction_bias`` updated from expert load
on the global batch (``fp.update_router_bias``).

transformers keeps the bias as a buffer and never updates it; DeepSeek-V3 (arXiv 2412.19437 §2.1.2, after
arXiv 2408.15664) updates it after each step as ``b_i += rate * sign(mean_load - load_i)``, where ``load_i`` is the
number of (token, k) routes to expert ``i`` in the step's batch and ``mean_load`` their mean over experts. Under
data parallelism (with or without expert parallelism) a rank sees only its own batch, so the loads are summed
over every rank before the update (under tensor parallelism: over the data-parallel ranks of one TP coordinate,
a TP group's ranks routing the same tokens): every rank then computes the bias one process computes on the
global batch.

Counting: ``fp.shard`` pre-hooks the fused experts module next to each such bias (the same MoE block); its
``top_k_index`` argument is counted when the backward passes through ``top_k_weights``, so a step counts what it
trained on: micro-batches under ``fp.no_sync`` add up, activation checkpointing's recompute is not counted twice,
and evaluation forwards are not counted.
"""
from __future__ import annotations

import torch
from torch import nn

from .._comm import collectives as comm
from ..errors import ConfigError, ShardingError
from .detect import _is_marked

BUFFER = "e_score_correction_bias"


class _Count(torch.autograd.Function):
    """Identity on the routing weights; its backward adds the routes per expert to ``acc``."""

    @staticmethod
    def forward(ctx, weights, index, acc):
        ctx.index, ctx.acc = index.detach(), acc
        return weights.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.acc.add_(torch.bincount(ctx.index.reshape(-1), minlength=ctx.acc.numel()).to(ctx.acc.device))
        return g, None, None


def _bias_modules(model: nn.Module) -> list:
    """``(name of the bias, owning module, its block)`` for every 1-D ``e_score_correction_bias`` buffer."""
    parents = {id(c): p for _, p in model.named_modules() for c in p.children()}
    return [(f"{n}.{BUFFER}" if n else BUFFER, m, parents.get(id(m)))
            for n, m in model.named_modules() if getattr(m, BUFFER, None) is not None and getattr(m, BUFFER).dim() == 1]


def install(model: nn.Module) -> None:
    """Count routes for every router bias whose block holds a fused experts module (before expert parallelism
    cuts ``num_experts`` to the local count); remember the biases it cannot count."""
    counted, uncounted = {}, []
    for name, owner, block in _bias_modules(model):
        n = getattr(owner, BUFFER).numel()
        experts = [c for c in (block.children() if block is not None else ()) if _is_marked(c) and c.num_experts == n]
        if len(experts) != 1:
            uncounted.append(name)
            continue
        acc = torch.zeros(n, dtype=torch.int64)
        counted[name] = (owner, acc)

        def hook(module, args, kwargs, acc=acc):
            if torch.compiler.is_compiling():     # a custom Function mutating a counter: kept out of compiled code
                model._fp_router_bias_compiled = True
                return None
            if len(args) == 3 and torch.is_tensor(args[2]) and args[2].requires_grad and torch.is_grad_enabled():
                if acc.device != args[1].device:
                    acc.data = acc.data.to(args[1].device)
                return (args[0], args[1], _Count.apply(args[2], args[1], acc)), kwargs
            return None
        experts[0].register_forward_pre_hook(hook, with_kwargs=True)
    if counted or uncounted:
        model._fp_router_bias = (counted, uncounted)


def update(model: nn.Module, rate: float) -> dict:
    """``fp.update_router_bias``: see ``api.update_router_bias``."""
    root = getattr(model, "_fp_root", None)
    if root is None:
        raise ShardingError(f"fp.update_router_bias: {type(model).__name__} is not sharded: call fp.shard(model, "
                            "...) first (it installs the counting)")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise ConfigError(f"fp.update_router_bias(rate={rate!r}): use a positive float (DeepSeek-V3 uses 0.001)")
    counted, uncounted = getattr(model, "_fp_router_bias", ({}, []))
    if uncounted:
        raise ConfigError(f"fp.update_router_bias: {uncounted[0]!r} has no fused experts module in its block (the "
                          "per-expert form or another layout): the engine cannot count its routes; update it yourself")
    if not counted:
        raise ConfigError(f"fp.update_router_bias: {type(model).__name__} has no router bias "
                          f"({BUFFER!r} buffer, DeepSeek-V3's aux-loss-free balancing); nothing to update")
    device = getattr(next(iter(counted.values()))[0], BUFFER).device
    loads = torch.stack([acc.to(device) for _, acc in counted.values()])
    if root.tp_mesh is not None:
        # the ranks of a tensor-parallel group route the same tokens (the experts run whole on the TP group's
        # shared rows): the global loads are the sum over the data-parallel ranks of one TP coordinate, the
        # shard group then the replicas (over the world each route would count tp times)
        m = root.mesh
        for group, size in ((m.shard_group, m.shard_size), (m.replicate_group, m.replicate_size)):
            if size > 1:
                comm.all_reduce(loads, group, kind="control", what="router loads for fp.update_router_bias")
    elif root.mesh.world_size > 1:
        comm.all_reduce(loads, None, kind="control", what="router loads for fp.update_router_bias")
    if not loads.any() and getattr(model, "_fp_router_bias_compiled", False):
        raise ConfigError("fp.update_router_bias: the model ran under torch.compile / fp.compile, where routes are "
                          "not counted yet; update the bias without compiling the MoE layers")
    if not loads.any():
        raise ConfigError("fp.update_router_bias: no route was counted since the last update: call it after "
                          "loss.backward() (and optimizer.step()); routes are counted in backward, so a frozen "
                          "router (routing weights without gradient) counts nothing")
    out = {}
    with torch.no_grad():
        for (name, (owner, acc)), load in zip(counted.items(), loads):
            bias = getattr(owner, BUFFER)
            f = load.to(torch.float64)
            bias.add_((rate * torch.sign(f.mean() - f)).to(bias.dtype))
            acc.zero_()
            out[name] = load.clone()
    return out
