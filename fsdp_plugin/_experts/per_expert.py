"""The per-expert form under expert parallelism: a block whose own forward routes and calls
``self.experts[e](rows)`` (an ``nn.ModuleList``/``nn.ModuleDict`` of per-expert MLPs, as the older Mixtral
``MixtralSparseMoeBlock``, Switch Transformers and remote-code models do).

The engine cannot call such experts the fused way (the routing is the block's own code), so the block's forward
runs twice, with no per-model code:

1. capture: every expert call records ``(expert, rows)`` and returns zeros (the block's output is dropped);
2. one exchange for all of them (the count all-to-all, then the rows and the reverse all-to-all of `dispatch.py`):
   each owner runs its local experts once on the rows of every rank of its EP group, rank-major (the global
   batch's order), an expert that got no row included (exact zero gradients);
3. replay (the RNG rewound to before 1, so dropout and router jitter draw the same numbers): every expert call
   returns its rows' outputs from 2, and the block's own code weights and combines them. The replay checks that
   each call gets the rows captured in 1 and refuses a block whose routing is not deterministic.

Gradients reach the tokens through the captured rows (the replay's rows are the same values, unused), so the block
computes the one-process function of its input; the router runs twice (once wasted).
An expert must map rows ``(n, width)`` to ``(n, width)`` with one positional argument, row by row.
"""
from __future__ import annotations

import math
import types

import torch
from torch import nn

from .._comm import collectives as comm
from ..errors import ConfigError
from .dispatch import INDEX_KIND, _AllToAll

_CAPTURE, _REPLAY = "capture", "replay"


class _State:
    def __init__(self):
        self.mode = None
        self.calls: list = []      # capture: (expert, rows) in call order
        self.queues: dict = {}     # replay: expert -> [(rows, output)] in call order


def install(block: nn.Module, container: nn.Module, emesh, name: str, capacity_factor=None) -> None:
    """Route the expert calls of ``block`` (the module holding ``container``) through the EP group;
    ``capacity_factor``: `ShardingConfig.expert_capacity_factor` (None: dropless)."""
    experts = list(container.children())
    state = _State()
    originals = [type(e).forward.__get__(e) for e in experts]
    for i, e in enumerate(experts):
        e.forward = types.MethodType(_expert_forward(state, i, f"{name}[{i}]"), e)
        e._fp_ep_original_forward = originals[i]
    block_forward = block.forward

    def forward(*args, **kwargs):
        template = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.is_floating_point()), None)
        if template is None:
            raise TypeError(f"expert_parallel: the block holding {name!r} was called without a floating-point "
                            "tensor argument (its hidden states): the engine routes only such blocks")
        rng = _rng_state(template.device)
        state.mode, state.calls = _CAPTURE, []
        try:
            block_forward(*args, **kwargs)
        finally:
            state.mode = None
        calls, state.calls = state.calls, []
        outputs = _run_experts(calls, len(experts), originals, emesh, name, template, capacity_factor)
        state.queues = {}
        for (e, rows), out in zip(calls, outputs):
            state.queues.setdefault(e, []).append((rows, out))
        _set_rng_state(template.device, rng)
        state.mode = _REPLAY
        try:
            result = block_forward(*args, **kwargs)
        finally:
            state.mode = None
            left, state.queues = sum(len(q) for q in state.queues.values()), {}
        if left:
            raise RuntimeError(f"expert_parallel: the block holding {name!r} called its experts {left} times fewer "
                               "on its second run than on its first: its routing is not deterministic, which the "
                               "per-expert form needs; drop expert_parallel for this model")
        return result

    block.forward = forward
    block._fp_ep_block_forward = block_forward


def _expert_forward(state: _State, index: int, name: str):
    def forward(self, *args, **kwargs):
        if state.mode is None:
            raise RuntimeError(f"expert_parallel: expert {name!r} was called outside its block's forward; under "
                               "expert parallelism only the block that holds it may call it")
        if len(args) != 1 or kwargs or not torch.is_tensor(args[0]) or args[0].dim() != 2:
            raise TypeError(f"expert_parallel: expert {name!r} was called with other than one 2-D tensor of rows; "
                            "the engine routes only expert(rows)")
        rows = args[0]
        if state.mode == _CAPTURE:
            state.calls.append((index, rows))
            return rows.new_zeros(rows.shape)
        queue = state.queues.get(index)
        if not queue:
            raise RuntimeError(f"expert_parallel: expert {name!r} was called more often on its block's second run "
                               "than on its first: the block's routing is not deterministic; drop expert_parallel")
        seen, out = queue.pop(0)
        with torch.no_grad():
            same = seen.shape == rows.shape and torch.allclose(seen, rows, rtol=0, atol=0, equal_nan=True)
        if not same:
            raise RuntimeError(f"expert_parallel: expert {name!r} got other rows on its block's second run than on "
                               "its first: the block's routing is not deterministic; drop expert_parallel")
        return out
    return forward


def _run_experts(calls: list, n_experts: int, originals: list, emesh, name: str, template,
                 capacity_factor=None) -> list:
    """Every call's output, computed by the expert's EP rank (collective over the EP group, always: a rank with
    no call still sends its counts and runs its local experts on what it receives). Under ``capacity_factor``
    each expert gets at most ``ceil(factor * routes / num_experts)`` of this rank's rows (``routes``: every row
    of this block call, ``tokens * top_k``), the first in call order and row order; the others' outputs are
    zeros."""
    ep, group, me = emesh.ep_size, emesh.ep_group, emesh.ep_rank
    local = n_experts // ep
    order = sorted(range(len(calls)), key=lambda c: calls[c][0])      # expert-major, calls in order (stable)
    widths = {calls[c][1].shape[1] for c in order}
    if len(widths) > 1:
        raise TypeError(f"expert_parallel: the experts of {name!r} were called with rows of widths {sorted(widths)}")
    width = widths.pop() if widths else 0
    kept = [rows.shape[0] for _, rows in calls]
    if capacity_factor is not None:
        left = [math.ceil(capacity_factor * sum(kept) / n_experts)] * n_experts
        for c, (e, _) in enumerate(calls):
            kept[c] = min(kept[c], left[e])
            left[e] -= kept[c]
    counts = [0] * n_experts
    for c, (e, _) in enumerate(calls):
        counts[e] += kept[c]
    send = torch.tensor([v for j in range(ep) for v in [width] + counts[j * local:(j + 1) * local]],
                        dtype=torch.int64, device=template.device)
    recv = torch.empty_like(send)
    what = f"expert all-to-all of {name!r}"
    comm.all_to_all(recv, send, [local + 1] * ep, [local + 1] * ep, group, what=what + " (counts)", kind=INDEX_KIND)
    got = recv.view(ep, local + 1).tolist()      # the one value the host waits for per block call
    width = max([width] + [g[0] for g in got])
    if width == 0:      # no rank of the EP group called an expert: nothing to run (the same on every rank)
        return []
    dtype = calls[0][1].dtype if calls else template.dtype
    x = (torch.cat([calls[c][1][:kept[c]] for c in order]) if calls
         else torch.zeros((0, width), dtype=dtype, device=template.device))
    if torch.is_grad_enabled() and not x.requires_grad:    # every rank's all-to-alls stay in its backward
        x = x.detach().requires_grad_(True)
    send_rows = [sum(counts[j * local:(j + 1) * local]) for j in range(ep)]
    recv_rows = [sum(g[1:]) for g in got]
    received = _AllToAll.apply(x, send_rows, recv_rows, group, what)
    chunks = received.split([c for g in got for c in g[1:]])      # source-major, local expert ascending
    pieces = []
    for lidx in range(local):
        inp = torch.cat([chunks[s * local + lidx] for s in range(ep)])
        out = originals[me * local + lidx](inp)
        if out.shape != inp.shape:
            raise ConfigError(f"expert_parallel: expert {me * local + lidx} of {name!r} maps rows {tuple(inp.shape)} "
                              f"to {tuple(out.shape)}; the engine routes only experts that keep the row width")
        pieces.append(out.split([g[1 + lidx] for g in got]))
    outbuf = (torch.cat([pieces[lidx][s] for s in range(ep) for lidx in range(local)])
              if local else received)
    back = _AllToAll.apply(outbuf, recv_rows, send_rows, group, what + " (combine)")
    parts = back.split([kept[c] for c in order])
    outputs: list = [None] * len(calls)
    for c, part in zip(order, parts):
        dropped = calls[c][1].shape[0] - kept[c]
        outputs[c] = torch.cat([part, part.new_zeros((dropped, width))]) if dropped else part
    return outputs


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
