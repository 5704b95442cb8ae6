"""``fp.optim.Muon``: ``torch.optim.Muon`` for a model sharded by ``fp.shard``, bit-identical to it on the
full tensors given the same (reduced) gradients.

Per parameter and step, as stock Muon: momentum ``lerp`` and the Nesterov update (elementwise, on this rank's
piece), Newton–Schulz (NS) on the whole matrix, decoupled weight decay, ``add_`` scaled by the learning rate
adjusted for the *full* shape. Only NS needs the whole matrix: a matrix whole on this rank is orthogonalized
here with no communication; a matrix cut between rows is orthogonalized by its owner (``_exchange``);
a 3-D (or higher) stack is a stack of matrices over its leading dimensions (MoE experts), cut between
matrices by the row-aligned layout, so each rank orthogonalizes the matrices it holds.
"""
from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr, \
    _zeropower_via_newtonschulz

from .._flat.layout import param_info
from ._exchange import orthogonalize_split
from ._checks import check_hyperparameters, check_managed, check_params


class Muon(torch.optim.Muon):
    """Muon (same signature and defaults as ``torch.optim.Muon``) on parameters of a sharded model.

    Accepts 2-D matrices and stacks of matrices (``ndim >= 3``, orthogonalized matrix by matrix), from the
    model's parameters, on every rank with the same parameter groups; the model must be sharded by its first
    step (building it before ``fp.shard`` is fine: parameters keep their identity).
    """

    _fp_sharding_aware = True    # the per-tensor guard lets it through

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None) -> None:
        check_hyperparameters(lr, momentum, weight_decay, adjust_lr_fn)
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        torch.optim.Optimizer.__init__(self, params, defaults)   # not Muon.__init__: it refuses 3-D stacks
        check_params(self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on every parameter with a gradient; collective over each split matrix's shard group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_managed([p for g in self.param_groups for p in g["params"]])
        items = [(p, g, self._update(p, g)) for g in self.param_groups for p in g["params"] if p.grad is not None]
        orth = self._orthogonalize(items)
        for (p, g, _), o in zip(items, orth):
            if p.numel():
                info = param_info(p)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(o.to(p.device), alpha=-_adjust_lr(g["lr"], g["adjust_lr_fn"], info.shape[-2:]))
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Momentum and Nesterov update of this rank's piece (stock Muon's elementwise part)."""
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        if p.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _orthogonalize(self, items: list) -> list:
        """NS of every item's full matrix, as this rank's piece (bf16); split matrices via their owners."""
        out: list = [None] * len(items)
        by_handle: dict = {}
        for k, (p, g, upd) in enumerate(items):
            info = param_info(p)
            args = (g["ns_coefficients"], g["ns_steps"], g["eps"])
            if info.split and len(info.shape) == 2:
                h = p._fp_handle
                slot = next(i for i, s in enumerate(h.slots) if s.param is p)
                by_handle.setdefault(id(h), (h, []))[1].append((k, (slot, upd, args)))
            else:
                out[k] = _ns_stack(upd, args)
        for h, entries in by_handle.values():
            entries.sort(key=lambda e: e[1][0])
            for (k, _), o in zip(entries, orthogonalize_split(h, [e for _, e in entries], _zeropower_via_newtonschulz)):
                out[k] = o
        return out


def _ns_stack(update: torch.Tensor, args: tuple) -> torch.Tensor:
    """NS of a local matrix, or matrix by matrix of a local stack (stock Muon on each); empty stays empty."""
    if update.numel() == 0:
        return update
    if update.dim() == 2:
        return _zeropower_via_newtonschulz(update, *args)
    mats = update.reshape(-1, *update.shape[-2:])
    return torch.stack([_zeropower_via_newtonschulz(m, *args) for m in mats]).view(update.shape)

