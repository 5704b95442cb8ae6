"""`shard()`: turn a module into units with flat sharded parameters, in place."""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .. import _log
from .._flat.flat_param import FlatParamHandle, ParamSlot
from .guards import install_guards
from .host_alloc import keep_freed_host_memory
from .._materialize.materialize import Materializer, decide_scatter, model_kind
from .._materialize.hf_init import retie
from .._groups.mesh import Mesh, build_mesh
from .._groups.shutdown import register_at_exit
from .._schedule.root import RootState
from .strategy import STRATEGIES, unit_policy
from .._schedule.unit import Unit
from .wrap import owner_unit, params_by_unit, recompute_selector, select_unit_modules
from ..config import ShardingConfig
from ..errors import ConfigError, ShardingError

_REDUCIBLE = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


def shard(model: nn.Module, config: Optional[ShardingConfig] = None, **kwargs) -> nn.Module:
    """Shard ``model`` in place (units chosen by the wrap policy) and return it.

    ``kwargs`` override fields of ``config`` (e.g. ``fp.shard(m, sharding_strategy="no_shard")``).
    Collective: every rank of the process group must call it with the same model structure.
    """
    if getattr(model, "_fp_root", None) is not None:
        raise ShardingError(f"{type(model).__name__} is already sharded: call fp.shard once, on the root module")
    nested = [n for n, m in model.named_modules() if getattr(m, "_fp_root", None) is not None]
    if nested:
        raise ShardingError(f"submodule {nested[0]!r} is already sharded: shard only the root, once, and choose "
                            "units with auto_wrap_policy")
    cfg = ShardingConfig.from_kwargs(config, **kwargs)
    mesh = build_mesh(STRATEGIES[cfg.sharding_strategy].scope, cfg.device_mesh)
    if mesh.world_size > 1:
        register_at_exit()  # process groups are in use: destroy them before interpreter exit
    device = _pick_device(model, cfg)
    _check_reducible(model, cfg)
    if cfg.activation_checkpointing is not None:
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    retie(model)
    units = select_unit_modules(model, cfg.auto_wrap_policy, cfg.ignored_modules)
    if device.type == "cpu" and mesh.world_size > 1:
        keep_freed_host_memory()    # per-step buffers are malloc blocks on the CPU (see _host_alloc)
    root = RootState(cfg, mesh, device)
    _build_units(model, units, cfg, mesh, device, root)
    _finish_buffers(model, cfg, mesh, device)
    _release_recording(model)
    model._fp_root = root
    install_guards(model, root)
    _log.on_sharded(model)   # unit table at INFO, phase memory at DEBUG (FSDP_PLUGIN_LOG)
    return model


def _release_recording(model: nn.Module) -> None:
    """Everything is real now: drop what fp.deferred_init recorded for this model."""
    from .. import _deferred
    _deferred.release(model)


def _pick_device(model: nn.Module, cfg: ShardingConfig) -> torch.device:
    if cfg.device is not None:
        return cfg.device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return comm.device()  # the one device choice for process-group tensors (the current CUDA device)
    real = [p.device for p in model.parameters() if not p.is_meta]
    return real[0] if real else torch.device("cpu")


def _check_reducible(model: nn.Module, cfg: ShardingConfig) -> None:
    mp = cfg.mixed_precision
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        dtype = mp.effective_reduce_dtype(p.dtype) if mp and p.dtype.is_floating_point else p.dtype
        if dtype not in _REDUCIBLE:
            raise ConfigError(f"parameter {name!r} would be reduced in {dtype}, which the "
                              f"{dist.get_backend() if dist.is_initialized() else 'process-group'} backend cannot "
                              "reduce: set MixedPrecision(reduce_dtype=torch.float32), or freeze/cast that parameter")


def apply_activation_checkpointing(model: nn.Module, policy) -> None:
    """Recompute the selected modules in backward (non-reentrant, so unit hooks run on recompute)."""
    from torch.utils.checkpoint import checkpoint

    selected = recompute_selector(model, policy)
    for m in list(model.modules()):
        if m is model or not selected(m):
            continue
        inner = m.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
        m.forward = forward


def _build_units(model, units, cfg: ShardingConfig, mesh: Mesh, device, root: RootState) -> None:
    unit_fqns = [f for f, _ in units]
    sites, names, owned = params_by_unit(model, unit_fqns, cfg.ignored_modules)
    model_kind(model)   # refuses a model partly changed after fp.deferred_init()
    scatter = decide_scatter(model, mesh.world_size, device)
    mat = Materializer(model, device, cfg.param_init_fn)
    buffer_sites = _buffer_sites_by_unit(model, unit_fqns)
    built: list = []
    # Scattering an eagerly built model: last unit first, so that the big early units (embeddings in the
    # root) are scattered once most of the model is already sharded and freed (setup peak ~ model + one unit).
    order = list(reversed(units)) if scatter else units
    try:
        for fqn, module in order:
            if not scatter or mesh.rank == 0:
                mat.materialize_buffers(buffer_sites[fqn])
            else:
                _empty_meta_buffers(buffer_sites[fqn], device)
            policy = unit_policy(cfg, mesh, fqn, module)
            handles = [_build_handle(group, sites, names, policy.mesh, cfg, device, mat, scatter, fqn or "<root>")
                       for group in group_params(owned[fqn]).values()]
            built.append(Unit(fqn, module, handles, root, reshard_after_forward=policy.reshard_after_forward))
    finally:
        mat.close()
    root.units.extend(reversed(built) if scatter else built)


def _buffer_sites_by_unit(model: nn.Module, unit_fqns: list) -> dict:
    """Each buffer belongs to the deepest unit enclosing the module that registers it."""
    out: dict = {f: [] for f in unit_fqns}
    for mfqn, m in model.named_modules():
        for n, b in m._buffers.items():
            if b is not None:
                out[owner_unit([mfqn], unit_fqns)].append((m, n))
    return out


def _empty_meta_buffers(sites: list, device) -> None:
    """Non-source ranks of a scatter only need storage: rank 0's values arrive by broadcast."""
    for m, n in sites:
        if m._buffers[n].is_meta:
            m._buffers[n] = torch.empty_like(m._buffers[n], device=device)


def group_params(params: list) -> "OrderedDict[tuple, list]":
    groups: OrderedDict = OrderedDict()
    for p in params:
        groups.setdefault((p.dtype, p.requires_grad), []).append(p)
    return groups


def _build_handle(params, sites, names, mesh: Mesh, cfg: ShardingConfig, device, mat: Materializer,
                  scatter: bool, label: str) -> FlatParamHandle:
    dtype, requires_grad = params[0].dtype, params[0].requires_grad
    values = mat.param_values(params) if (not scatter or mesh.rank == 0) else None
    slots = [ParamSlot(p, names[id(p)], [(f, m, a) for f, m, a in sites[id(p)]], p.shape) for p in params]
    compute, reduce = handle_dtypes(cfg.mixed_precision, dtype)
    shard_device = torch.device("cpu") if cfg.cpu_offload else device
    handle = FlatParamHandle(slots, mesh, dtype, requires_grad, device, compute, reduce, shard_device,
                             label=label, timeout_s=comm.default_timeout_s(cfg.timeout_s))
    if scatter:
        _scatter_from_rank0(handle, values, mesh)
    else:
        for slot, value in zip(slots, values):
            handle.fill_from_full(slot, value)
    return handle


def handle_dtypes(mp, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(compute, reduce) dtype of a flat handle whose master dtype is ``dtype`` under MixedPrecision ``mp``
    (None: no mixed precision). Non-floating handles keep their dtype. Shared with ``fp.plan``."""
    if mp is None or not dtype.is_floating_point:
        return dtype, dtype
    return mp.param_dtype or dtype, mp.effective_reduce_dtype(dtype)


def _scatter_from_rank0(handle: FlatParamHandle, values, mesh: Mesh) -> None:
    """Rank 0's full values win: it sends each rank the chunk that rank keeps.

    No full flat copy is made: a chunk that lies inside one parameter is sent from that parameter's memory,
    others are assembled chunk by chunk; every rank receives straight into its shard when it can.
    """
    chunks = None
    if mesh.rank == 0:
        by_shard_rank = [_chunk_of(handle, values, j) for j in range(handle.padded // handle.chunk)]
        chunks = [by_shard_rank[j] for j in mesh.shard_rank_of]
        values.clear()      # the caller's list: the chunks (views or copies) keep what is still needed
    # Received on the compute device (NCCL cannot scatter host memory), then moved to the shard's home;
    # straight into the shard when that is its home already (no second chunk-sized buffer at setup).
    direct = handle.flat_shard.device == torch.device(handle.device) and handle.flat_shard.is_contiguous()
    mine = handle.flat_shard if direct else torch.empty(handle.chunk, dtype=handle.dtype, device=handle.device)
    comm.scatter(mine, chunks, src=0, group=None)
    if not direct:
        handle.flat_shard.copy_(mine)


def _chunk_of(handle: FlatParamHandle, values, j: int) -> torch.Tensor:
    """Shard rank ``j``'s chunk of the flat layout: a view of one parameter's values when it lies inside it."""
    lo, hi = j * handle.chunk, (j + 1) * handle.chunk
    for slot, v in zip(handle.slots, values):
        if slot.offset <= lo and hi <= slot.offset + slot.numel and v.dtype == handle.dtype \
                and v.device == handle.device and v.is_contiguous():
            return v.detach().reshape(-1)[lo - slot.offset:hi - slot.offset]
    out = torch.zeros(handle.chunk, dtype=handle.dtype, device=handle.device)
    for slot, v in zip(handle.slots, values):
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            out[a - lo:b - lo].copy_(v.detach().reshape(-1)[a - slot.offset:b - slot.offset])
    return out


def _finish_buffers(model: nn.Module, cfg: ShardingConfig, mesh: Mesh, device) -> None:
    """Move buffers to the device, cast to buffer_dtype, and make rank 0's values everyone's."""
    bdtype = cfg.mixed_precision.buffer_dtype if cfg.mixed_precision else None
    seen: set[int] = set()
    for m in model.modules():
        for n, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.device != device:
                m._buffers[n] = b = b.to(device)
            if bdtype is not None and b.is_floating_point():
                m._buffers[n] = b = b.to(bdtype)
            if mesh.world_size > 1 and id(b) not in seen:
                comm.broadcast(b, src=0, group=None)
            seen.add(id(b))
