"""Tensor-parallel parameters inside flat buffers: what is kept of a DTensor parameter, and its forward view.

A parameter that arrives at ``fp.shard`` as a DTensor on a tensor-parallel (TP) mesh dimension is stored like
any other: its *local* TP tensor is the "full" parameter of its slot (``ParamSlot.shape`` is the local shape;
the flat buffer, the rows rule and the data-parallel collectives never see the global tensor). What makes it a
DTensor again is kept here, on ``param._fp_tp``: in forward every unsharded view is wrapped by
``DTensor.from_local`` with the original spec, so TP's own hooks and collectives run unchanged; its backward
returns the local gradient in the original placement (``Partial`` gradients of ``Replicate`` parameters are
all-reduced over TP there), so the flat gradient holds plain local gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPSpec:
    """How a parameter's local tensor sits in the global one.

    ``mesh``: the 1-D TP DeviceMesh; ``placements``: ``(Shard(d),)`` or ``(Replicate(),)``; ``shape``/``stride``:
    the global tensor's; ``offset``: the global index of the local tensor's first element on every dim (the
    box of the global tensor this rank's local tensor is: ``offset``, local shape).
    """

    mesh: object
    placements: tuple
    shape: torch.Size
    stride: tuple
    offset: tuple
    # a plain replicated parameter whose gradient is partial over TP (transformers' replicated_with_grad_allreduce,
    # Qwen3's per-head q_norm/k_norm): the model sees a plain tensor; its gradient is summed over the TP group
    grad_sum: bool = False

    @property
    def sharded(self) -> bool:
        """The local tensor is a proper part of the global one (its gradient norm sums over TP)."""
        return any(p.is_shard() for p in self.placements) and self.mesh.size() > 1


def tp_spec(p) -> Optional[TPSpec]:
    """The TP spec recorded on parameter ``p`` by ``fp.shard`` (None: a plain parameter)."""
    return getattr(p, "_fp_tp", None)


def as_dtensor(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """``local`` (a view of the unsharded buffer) as the DTensor the model was parallelized with; autograd
    connected (the gradient arrives as a plain local tensor in the forward placement)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


class _SumGradOverTP(torch.autograd.Function):
    """Identity in forward; backward sums the gradient over the TP group (each TP rank's covers its own heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)     # TP's own traffic, as DTensor's collectives (not fp.comm_stats')
        return g, None


def as_parallel(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """``local`` as the model sees it: the DTensor it was parallelized with, or (``grad_sum``) the plain tensor
    whose gradient is summed over TP."""
    if spec.grad_sum:
        return _SumGradOverTP.apply(local, spec.mesh.get_group()) if torch.is_grad_enabled() else local
    return as_dtensor(local, spec)


def local_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient handed back by ``from_local``'s backward may still be an in-flight functional collective."""
    wait = getattr(g, "wait", None)
    return wait() if callable(wait) and type(g).__name__ == "AsyncCollectiveTensor" else g


def full_tensor(local: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """The global tensor from every TP rank's local tensor (collective over the TP group)."""
    return as_dtensor(local, spec).full_tensor()
