"""The experts module's forward under expert parallelism: dispatch by all-to-all, the model's own experts code
on the rows a rank receives, combine by the reverse all-to-all.

Per call, on every rank of an EP group (always, even with no rows: the all-to-alls and the backward stay paired,
so a rank or expert that gets no token neither hangs nor skips a collective):

1. the ``(token, k)`` pairs are sorted by expert (stable), so the rows for EP rank ``j`` (experts
   ``[j*E_local, (j+1)*E_local)``) are contiguous and in ascending expert order;
2. the routes per expert are exchanged (an all-to-all of ``num_experts`` integers, the only one the host waits
   for: it reads the splits), which also gives each received row its local expert id (rows arrive
   expert-ascending per source); then the rows themselves (uneven splits; `_AllToAll` is autograd-aware: its
   backward is the reverse all-to-all), which the host does not wait for;
3. the owner runs the experts module's original forward on the rows it received, with ``top_k = 1`` and weight
   1, whichever implementation the config selects (eager, batched_mm, grouped_mm): each row goes through exactly
   one expert, so the result is that expert's output for that row;
4. the rows return in the order they were sent; the source weights them by the router's ``top_k_weights`` and
   sums each token's rows in ascending expert order (what the eager loop does), dropless.

An owner that received no rows still runs step 3 on an empty batch and ties its experts into the graph with an
empty slice, so their gradients are exact zeros (as in one process, where a stacked experts tensor gets zero
rows for an expert no token chose), not None.
"""
from __future__ import annotations

import math
import types

import torch
from torch import nn

from .._comm import collectives as comm

KIND = "all_to_all"            # fp.comm_stats: the rows (forward dispatch + combine, and their backward)
INDEX_KIND = "all_to_all_index"   # the counts and expert ids of each dispatch


class _AllToAll(torch.autograd.Function):
    """Rows ``x`` (``(sum(send), H)``) to the EP group: ``send[j]`` rows to rank ``j``, ``recv[j]`` from it.
    Backward sends the gradients back the same way reversed (a reverse all-to-all, splits swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, group, what):
        ctx.send, ctx.recv, ctx.group, ctx.what = send, recv, group, what
        return _exchange(x, send, recv, group, what)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.recv, ctx.send, ctx.group, ctx.what + " (backward)"), None, None, None, None


def _exchange(x: torch.Tensor, send: list, recv: list, group, what: str, kind: str = KIND) -> torch.Tensor:
    """``comm.all_to_all`` of whole rows (it counts elements: each split is scaled by the row width). The host
    does not wait for it (on NCCL the current stream does): the splits are already known."""
    width = math.prod(x.shape[1:])
    x = x.contiguous()
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_to_all(out.view(-1), x.view(-1), [r * width for r in recv], [s * width for s in send], group,
                    what=what, kind=kind, host=False)
    return out


def exchange_counts(counts: torch.Tensor, ep: int, group, what: str) -> tuple:
    """The one exchange the host waits for per experts call: ``counts`` (routes per global expert,
    ``ep * local``) to the EP group. Returns (rows sent to each EP rank, rows received from each, the received
    ``(ep, local)`` count matrix), read by the host at once in one device-to-host copy."""
    got = torch.empty_like(counts)
    local = counts.numel() // ep
    comm.all_to_all(got, counts, [local] * ep, [local] * ep, group, what=what + " (counts)", kind=INDEX_KIND)
    got = got.view(ep, local)
    both = torch.cat([counts.view(ep, local).sum(1), got.sum(1)]).tolist()
    return both[:ep], both[ep:], got


def _within_capacity(order, sorted_experts, factor: float, tokens: int, k: int, n_experts: int):
    """The pairs kept under ``expert_capacity_factor``: per expert the first ``ceil(factor * tokens * k / N)``
    in token order (``order`` is stable, so each expert's pairs are in token order already)."""
    cap = math.ceil(factor * tokens * k / n_experts)
    counts = torch.bincount(sorted_experts, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    keep = torch.arange(order.numel(), device=order.device) - starts[sorted_experts] < cap
    return order[keep], sorted_experts[keep]


def install(module: nn.Module, emesh, name: str, capacity_factor=None) -> None:
    """Route ``module``'s calls through the EP group (an instance attribute: the class stays the model's);
    ``capacity_factor``: `ShardingConfig.expert_capacity_factor` (None: dropless)."""
    original = type(module).forward.__get__(module)
    local = module.num_experts
    group, ep = emesh.ep_group, emesh.ep_size

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs:
            raise TypeError(f"expert_parallel: {name!r} was called with extra arguments; the engine routes only "
                            "experts(hidden_states, top_k_index, top_k_weights)")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        k = top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)           # (token, k) pairs, expert-major
        sorted_experts = experts[order]
        if capacity_factor is not None:
            order, sorted_experts = _within_capacity(order, sorted_experts, capacity_factor, x.shape[0], k,
                                                     local * ep)
        token = order // k
        what = f"expert all-to-all of {name!r}"
        send_l, recv_l, got = exchange_counts(torch.bincount(sorted_experts, minlength=local * ep), ep, group, what)
        # the rows from each source come expert-ascending: their local expert ids follow from the counts
        ids = torch.repeat_interleave(torch.arange(local, device=got.device).repeat(ep), got.reshape(-1),
                                      output_size=sum(recv_l))
        rows = _AllToAll.apply(x[token], send_l, recv_l, group, what)
        ones = torch.ones((rows.shape[0], 1), dtype=top_k_weights.dtype, device=rows.device)
        out = original(rows, ids.unsqueeze(-1), ones)
        if rows.shape[0] == 0 and torch.is_grad_enabled():    # no rows: exact zero gradients, not None
            out = out + sum(p.reshape(-1)[:0].sum() for p in self.parameters(recurse=False) if p.requires_grad)
        back = _AllToAll.apply(out, recv_l, send_l, group, what + " (combine)")
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        final = torch.zeros_like(x)
        final.index_add_(0, token, weighted.to(final.dtype))   # each token's rows in ascending expert order
        return final.reshape(shape)

    module.forward = types.MethodType(forward, module)
    module._fp_ep_original_forward = original
