"""Public operations on a sharded model: no_sync, full_params, clip_grad_norm_, full_state_dict,
is_sharded, register_forward_method."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterable, Iterator, Union

import torch
import torch.distributed as dist
from torch import nn

from ._comm import collectives as comm, failure
from ._experts.spec import ep_spec, full_tensor as ep_full_tensor
from ._flat.dtensor import full_tensor, tp_spec
from ._flat.layout import is_persistent_buffer
from ._flat.packed import is_packed, quant_state_entries, state_value
from ._schedule.join import note_clip
from .errors import NonFiniteGradientError, ShardingError


def is_sharded(module: nn.Module) -> bool:
    """True if ``module`` is the root of a model sharded by `fp.shard`."""
    return getattr(module, "_fp_root", None) is not None


def _root(module: nn.Module):
    root = getattr(module, "_fp_root", None)
    if root is None:
        raise ShardingError(f"{type(module).__name__} is not sharded: call fp.shard(model, ...) on it first "
                            "(pass the root module that fp.shard returned)")
    return root


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally, without communication, for the backwards run inside.

    Unsharded gradients are kept per unit (memory: one full gradient per unit) until the first
    backward outside the context reduces them together with its own.
    """
    root = _root(model)
    previous = root.reduction.enter_no_sync()
    try:
        yield
    finally:
        root.reduction.restore_window(previous)


@contextlib.contextmanager
def full_params(model: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Every parameter unsharded (full shape, master dtype) inside the block.

    ``model.state_dict()``/``load_state_dict()`` work on full tensors here; with ``writeback`` the full
    values are copied back into the shards on exit (so in-place edits and loads persist).
    Collective over the shard group (every rank enters it); not inside backward.
    """
    root = _root(model)
    if root.full_params_active:
        yield
        return
    gathered = [(unit, h, h.gather_master()) for unit in root.units for h in unit.handles]
    root.enter_full_params()
    for unit, h, full in gathered:
        unit.show_full(h, full)
    try:
        yield
    finally:
        root.exit_full_params()
        for unit, h, full in gathered:
            if writeback:
                h.write_back(full)
            unit.show_originals(h)


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict:
    """The plain model's ``state_dict()`` (same keys, full tensors on CPU) on rank 0; ``{}`` elsewhere.

    Streams unit by unit: only one unit is unsharded at a time and the result is built once, on CPU.
    """
    failure.refuse("fp.full_state_dict")
    root = _root(model)
    keep = not rank0_only or root.mesh.rank == 0
    values: dict[int, torch.Tensor] = {}
    for unit in root.units:
        for h in unit.handles:
            full = h.gather_master()
            for s, spec in zip(h.slots, h._tp):
                v = full[s.offset:s.offset + s.numel].view(s.shape)
                if spec is not None:       # a TP box: the global tensor (collective over TP, every rank)
                    v = full_tensor(v, spec)
                if ep_spec(s.param) is not None:   # local experts: the global tensor (collective over EP)
                    v = ep_full_tensor(v, ep_spec(s.param))
                if keep:
                    values[id(s.param)] = v.to("cpu", copy=True)
            del full
    if not keep:
        return {}
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[pre + name] = state_value(p, values.get(id(p), p.detach().cpu()))
                if is_packed(p):      # as the plain model's state_dict(): bitsandbytes' quant_state entries
                    out.update(quant_state_entries(p, pre + name))
        for name, b in module._buffers.items():
            if is_persistent_buffer(module, name):
                out[pre + name] = b.detach().cpu()
    return out


def reset(model: nn.Module) -> None:
    """Abandon the current step after an exception in forward or backward; the next step runs normally.

    Every unit returns to the sharded idle state, collectives already issued are waited for (every rank
    issued them), gradients not yet reduced (and ``no_sync`` accumulations) are dropped, and the
    end-of-backward bookkeeping an interrupted backward never ran is cleared. Gradients already reduced
    into ``p.grad`` are left: call ``optimizer.zero_grad()`` before the next step. Call it on every rank.
    Raises `CollectiveError` (after cleaning up) if a collective of the abandoned step failed.
    """
    _root(model).reset()


def register_forward_method(model: nn.Module, name: str) -> None:
    """Run ``model.<name>(...)`` through the root unit's forward hooks, like ``model(...)``.

    For trainers whose entry point is not ``forward`` (Lightning's ``training_step``...): the root
    parameters are unsharded for the call and backward hooks are registered on its outputs.
    """
    unit = _root(model).root_unit
    method = getattr(type(model), name, None)
    if method is None:
        raise ShardingError(f"{type(model).__name__} has no method {name!r} to register")

    root = _root(model)
    join = root.join

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        if join is not None:
            join.entry = name       # a Join's joined ranks replay this method, not forward
        if root.eval_join is not None:
            root.eval_join.entry = name     # likewise fp.join's finished ranks
        args, kwargs = unit.pre_forward(args, kwargs)
        return unit.post_forward(method(model, *args, **kwargs))

    setattr(model, name, wrapped)


def clip_grad_norm_(parameters: Union[nn.Module, Iterable[torch.Tensor]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the global norm (every rank).

    Equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each element is counted once
    (shard pieces summed across the shard group; replicated parameters counted on one rank only).
    Collective over the shard group: call it on every rank.
    """
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    note_clip(clip_grad_norm_, max_norm, norm_type)       # a Join's joined ranks replay it
    managed = [p for p in params if p.grad is not None and getattr(p, "_fp_handle", None) is not None]
    # TP-sharded boxes are also summed over the TP group; TP-replicated and plain parameters are not
    tp_split = [p.grad for p in managed if tp_spec(p) is not None and tp_spec(p).sharded]
    sharded = [p.grad for p in managed if not (tp_spec(p) is not None and tp_spec(p).sharded)]
    plain = [p.grad for p in params if p.grad is not None and getattr(p, "_fp_handle", None) is None]
    handle = managed[0]._fp_handle if managed else \
        next((p._fp_handle for p in params if getattr(p, "_fp_handle", None) is not None), None)
    # expert_parallel: experts are split over the EP group x efsdp = the dense shard group, each element held
    # once there, so their terms are summed over the dense shard group with the rest (``_experts/layout.py``)
    mesh = getattr(handle.mesh, "dense", None) or handle.mesh if handle is not None else None
    group = mesh.shard_group if handle is not None else None
    first_in_group = handle is None or mesh.shard_rank == 0
    device = handle.device if handle is not None else (grads[0].device if grads else torch.device("cpu"))
    local = _local_norm_term(sharded, norm_type, device)
    if first_in_group:
        local = _combine(local, _local_norm_term(plain, norm_type, device), norm_type)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    tp_mesh = next((tp_spec(p).mesh for p in params if tp_spec(p) is not None), None)
    if tp_mesh is not None:      # [dp term, TP-split term]: the second also summed over TP
        local = torch.stack([local, _local_norm_term(tp_split, norm_type, device).to(local.dtype)])
    if handle is not None and mesh.shard_size > 1:
        comm.all_reduce(local, group, op=op, kind="control")
    if tp_mesh is not None:
        tp_term = local[1:].clone()
        if tp_mesh.size() > 1:
            comm.all_reduce(tp_term, tp_mesh.get_group(0), op=op, kind="control")
        local = _combine(local[0], tp_term[0], norm_type)
    total = local if math.isinf(norm_type) else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise NonFiniteGradientError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}: some gradient is NaN or inf, "
            "so clipping cannot make the step safe. Skip this step (or use fp.GradScaler, which skips it for you), "
            "lower the learning rate, or check the loss for overflow; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _local_norm_term(grads, norm_type: float, device) -> torch.Tensor:
    """max|g| for the inf norm, else sum |g|^p, in float32 (float64 grads keep float64)."""
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().to(dtype) if g.numel() else torch.zeros((), dtype=dtype, device=g.device)
                            for g in grads]).max().to(device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=dtype) for g in grads])
    return norms.pow(norm_type).sum().to(device)


def _combine(a: torch.Tensor, b: torch.Tensor, norm_type: float) -> torch.Tensor:
    return torch.maximum(a, b.to(a.dtype)) if math.isinf(norm_type) else a + b.to(a.dtype)
