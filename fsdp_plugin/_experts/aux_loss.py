"""The router's auxiliary load-balancing loss on the global batch under expert parallelism.

transformers computes it (``output_router_logits=True``) with its module-level ``load_balancing_loss_func`` from
the router logits of the tokens a process sees: under data parallelism, each rank's own batch. It is a product of
batch means (token fraction per expert × mean router probability), so the ranks' values do not average to the
value of one process on the global batch. Under ``expert_parallel`` the engine promises the one-process numbers,
so while a sharded model's forward runs, that function gets every rank's router logits (all-gathered over the
data-parallel world, rank-major: the global batch's order) and computes transformers' own formula on them.

Gradients: every rank adds the same global value to its loss and the engine averages gradients over the N ranks,
so the gather's backward sums the ranks' gradients of each rank's slice (a reduce-scatter): N identical
upstream gradients sum to N times one, which the average divides back -- the one-process gradient.
Only functions with transformers' signature ``(gate_logits, num_experts, top_k, attention_mask)`` are wrapped;
a model whose function differs keeps the per-rank value (README "Experts (expert parallel)").
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys

import torch
from torch import nn

from .._comm import collectives as comm

KIND = "router_logits"      # fp.comm_stats kind of the gathered logits
_GROUP: contextvars.ContextVar = contextvars.ContextVar("fp_experts_aux_group", default=None)
_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]


class _Gather(torch.autograd.Function):
    """Rows of every rank, rank-major; backward: the sum over ranks of the gradient of this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.rows = group, x.shape[0]
        x = x.contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather(out.view(-1), x.view(-1), group, kind=KIND, what="router logits for the global aux loss")
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        out = torch.empty((ctx.rows, *g.shape[1:]), dtype=g.dtype, device=g.device)
        comm.reduce_scatter(out.view(-1), g.view(-1), ctx.group, what="router logits' gradient (global aux loss)")
        return out, None, None


def _global(original):
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, *args, **kwargs):
        group = _GROUP.get()
        if group is None or not isinstance(gate_logits, tuple) or not gate_logits:
            return original(gate_logits, *args, **kwargs)
        n = comm.group_size(group)
        gate_logits = tuple(_Gather.apply(g, group, n) for g in gate_logits)
        args = list(args)
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if mask is not None:
            with torch.no_grad():
                mask = _Gather.apply(mask, group, n)
            if len(args) > 2:
                args[2] = mask
            else:
                kwargs["attention_mask"] = mask
        return original(gate_logits, *args, **kwargs)
    load_balancing_loss_func._fp_global = True
    return load_balancing_loss_func


def install(model: nn.Module, group) -> bool:
    """Wrap the model's module's ``load_balancing_loss_func`` (once per process) and make ``model``'s forward
    run with the global variant; False when the model's module has no such function with transformers' signature."""
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "load_balancing_loss_func", None)
    if fn is None:
        return False
    if not getattr(fn, "_fp_global", False):
        if list(inspect.signature(fn).parameters)[:4] != _SIGNATURE:
            return False
        module.load_balancing_loss_func = fn = _global(fn)
    forward = model.forward

    @functools.wraps(forward)
    def global_aux_forward(*args, **kwargs):
        token = _GROUP.set(group)
        try:
            return forward(*args, **kwargs)
        finally:
            _GROUP.reset(token)
    model.forward = global_aux_forward
    return True
