"""`shard()`: turn a module into units with flat sharded parameters, in place."""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .. import _context, _log
from .._flat import offload as _offload
from .._flat.flat_param import FlatParamHandle, ParamSlot
from .._flat.packed import carrier_shape, is_packed, prepare as prepare_packed
from .._flat import packed_quantize
from .checkpointing import apply_activation_checkpointing
from .generate import install_synced_generate
from .guards import install_guards
from .library_save import install_library_save
from .host_alloc import keep_freed_host_memory
from .precision import fp32_buffers, fp32_param_ids, fp32_regions, install_casts
from .._materialize.materialize import Materializer, decide_scatter, model_kind
from .._materialize.hf_init import retie
from .._groups import timeouts as group_timeouts
from .._groups.mesh import Mesh, build_mesh, control_group, secondary_group
from .._flat.secondary import SecondaryShard
from .._experts.layout import prepare as prepare_experts, split_expert_params
from .._experts.router_bias import install as install_router_bias
from .._groups.shutdown import register_at_exit
from .._schedule.join import make_joinable
from .._schedule.root import RootState
from .strategy import STRATEGIES, secondary_size, unit_policy
from .tensor_parallel import strip_dtensors, tp_rank_and_size
from .._schedule.unit import Unit
from .some_ranks_default import log_default_cost
from .wrap import owner_unit, params_by_unit, select_unit_modules, some_ranks_fqns
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
    if cfg.context_parallel > 1:
        _context.refuse_unsplittable(model, cfg.context_parallel)   # before any collective or change
    tp_mesh = strip_dtensors(model, cfg.device_mesh, cfg.param_init_fn)   # DTensor params -> local + spec
    mesh = build_mesh(STRATEGIES[cfg.sharding_strategy].scope, cfg.device_mesh, tp_rank_and_size(tp_mesh)[1],
                      cfg.timeout_s, cp_size=cfg.context_parallel)
    if mesh.world_size > 1:
        register_at_exit()  # process groups are in use: destroy them before interpreter exit
    device = _pick_device(model, cfg)
    group_timeouts.check(mesh, cfg.timeout_s, device, control_group())   # torch's timeouts outlast our deadline
    install_router_bias(model)    # DeepSeek's router bias: routes counted for fp.update_router_bias
    # issue 55: experts cut to this rank's (``_experts/``); under TP whole on every TP rank
    experts_mesh = prepare_experts(model, cfg, mesh, device, tp_mesh)
    _check_reducible(model, cfg)
    prepare_packed(model, cfg.ignored_modules)   # quantized bases: refuse what cannot be sharded exactly
    retie(model)
    some_ranks = set(some_ranks_fqns(model, cfg.some_ranks_modules, cfg.ignored_modules))
    regions = fp32_regions(model, cfg.mixed_precision)
    units = select_unit_modules(model, cfg.auto_wrap_policy, cfg.ignored_modules, some_ranks)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, [m for f, m in units if f])
    copier = _offload.for_config(cfg.cpu_offload, device)   # cpu_offload on CUDA (a warning on CPU: a no-op)
    if (device.type == "cpu" and mesh.world_size > 1) or copier is not None:
        keep_freed_host_memory()    # per-step buffers (and the host optimizer's temporaries) are malloc blocks
    root = RootState(cfg, mesh, device)
    root.offload = copier
    root.tp_mesh = tp_mesh
    root.experts_mesh = experts_mesh
    root.on_demand = cfg.some_ranks_modules is None and bool(some_ranks)   # default encoders: schedule/on_demand.py
    _build_units(model, units, cfg, mesh, device, root, some_ranks, regions)
    _finish_buffers(model, cfg, mesh, device, fp32_buffers(model, cfg.mixed_precision, regions))
    if regions:
        install_casts(regions, cfg.mixed_precision.param_dtype, device.type)
    _release_recording(model)
    model._fp_root = root
    if mesh.cp_size > 1:
        _context.install(model, mesh, cfg.context_parallel_attention)   # attention registry + split/loss hooks
    make_joinable(model, root)   # torch's Join([model]) for uneven inputs
    install_guards(model, root)
    install_synced_generate(model, root)   # generate(): ranks that finish early keep stepping
    install_library_save(model)   # PEFT's / transformers' own model.save_pretrained(dir): collective, no gather
    if cfg.some_ranks_modules is None:
        log_default_cost(model, root.units)   # the default chose encoders: say what they cost, once
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


def _build_units(model, units, cfg: ShardingConfig, mesh: Mesh, device, root: RootState, some_ranks: set,
                 regions: list) -> None:
    unit_fqns = [f for f, _ in units]
    sites, names, owned = params_by_unit(model, unit_fqns, cfg.ignored_modules)
    fp32_ids = fp32_param_ids(model, cfg.mixed_precision, regions, sites)
    model_kind(model)   # refuses a model partly changed after fp.deferred_init()
    # each rank of a tensor-parallel model holds its own box: nothing to take from rank 0
    scatter = decide_scatter(model, mesh.world_size, device) if root.tp_mesh is None else False
    mat = Materializer(model, device, cfg.param_init_fn)
    buffer_sites = _buffer_sites_by_unit(model, unit_fqns)
    built: list = []
    progress = _progress(model, mesh)
    hpz = secondary_size(cfg, mesh.shard_size)
    hpz_group = secondary_group(mesh, hpz, cfg.timeout_s) if hpz else None
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
            dense, experts = split_expert_params(owned[fqn])
            handles = [_build_handle(group, dtype, fp32, sites, names, policy.mesh, cfg, device, mat, scatter,
                                     fqn or "<root>", root.offload, packed)
                       for (dtype, _, fp32, packed), group in group_params(dense, cfg.mixed_precision,
                                                                           fp32_ids).items()]
            # experts under expert_parallel: their own handles on the experts' mesh, each rank's own values
            handles += [_build_handle(group, dtype, fp32, sites, names, root.experts_mesh, cfg, device, mat, False,
                                      fqn or "<root>", root.offload, packed)
                        for (dtype, _, fp32, packed), group in group_params(experts, cfg.mixed_precision,
                                                                            fp32_ids).items()]
            some = fqn in some_ranks    # held from the root's pre-forward to the end of backward: never resharded
            if hpz_group is not None and fqn and not some:
                for h in handles:
                    h.secondary = SecondaryShard(hpz_group, hpz, dist.get_rank(hpz_group))
            built.append(Unit(fqn, module, handles, root, reshard_policy=policy.reshard_after_forward and not some,
                              some_ranks=some))
            if progress is not None:
                progress(sum(h.total * h.dtype.itemsize for h in handles))
        if progress is not None:
            progress(None)
    finally:
        mat.close()
    root.units.extend(reversed(built) if scatter else built)


def _progress(model: nn.Module, mesh: Mesh):
    """``advance(nbytes)`` for rank 0's progress lines (``FSDP_PLUGIN_LOG=INFO``) while a large model's units
    are built, ``advance(None)`` at the end; None for small models, other ranks, or INFO off."""
    from .. import _progress as progress_lines

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    lines = progress_lines.logged("fp.shard", total) if mesh.rank == 0 else None
    if lines is None:
        return None
    done = [0]
    lines(0, total)

    def advance(nbytes: Optional[int]) -> None:
        done[0] = total if nbytes is None else min(total, done[0] + nbytes)
        lines(done[0], total)
    return advance


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


def group_params(params: list, mp=None, fp32_ids: frozenset = frozenset()) -> "OrderedDict[tuple, list]":
    """A unit's parameters by ``(master dtype, requires_grad, fp32, packed)``, one flat handle each (shared
    with fp.plan); ``fp32``: the parameter's ``id`` is in ``fp32_ids`` (an fp32 module's, see ``precision.py``);
    ``packed``: quantized bytes (``_flat/packed.py``), kept in their storage dtype and never grouped with real
    values of that dtype. The master dtype is the loaded dtype, or ``mp.master_dtype`` for trainable 16-bit
    parameters under a 16-bit ``MixedPrecision`` (see ``MixedPrecision.master_dtype_for``)."""
    groups: OrderedDict = OrderedDict()
    for p in params:
        if is_packed(p):     # a 4-bit weight still pending (fp.plan before fp.shard): its storage dtype
            planned = packed_quantize.planned(p)
            groups.setdefault((planned[1] if planned else p.dtype, p.requires_grad, False, True), []).append(p)
            continue
        if carrier_shape(p) is not None:    # a torchao NF4 weight not prepared yet (fp.plan): its uint8 carrier
            groups.setdefault((torch.uint8, False, False, True), []).append(p)
            continue
        fp32 = id(p) in fp32_ids
        dtype = mp.master_dtype_for(p.dtype, p.requires_grad, fp32) if mp is not None else p.dtype
        groups.setdefault((dtype, p.requires_grad, fp32, False), []).append(p)
    return groups


def _build_handle(params, dtype: torch.dtype, fp32: bool, sites, names, mesh: Mesh, cfg: ShardingConfig, device,
                  mat: Materializer, scatter: bool, label: str, offload=None, packed: bool = False) -> FlatParamHandle:
    """One flat handle whose master shard is ``dtype`` (the loaded values are cast into it); ``packed``:
    quantized bytes, gathered and kept in their storage dtype, never cast or quantized (``_flat/packed.py``)."""
    requires_grad = params[0].requires_grad
    if dtype != params[0].dtype and fp32:
        _log.logger.info("unit %s: %d trainable %s parameters of fp32 modules get %s master shards", label,
                         len(params), params[0].dtype, dtype)
    elif dtype != params[0].dtype:    # accelerate logs its upcast too: the memory is the user's to know about
        _log.logger.info("unit %s: %d trainable %s parameters get %s master shards (MixedPrecision(master_dtype="
                         "None) keeps %s)", label, len(params), params[0].dtype, dtype, params[0].dtype)
    values = mat.param_values(params) if (not scatter or mesh.rank == 0) else None
    slots = [ParamSlot(p, names[id(p)], [(f, m, a) for f, m, a in sites[id(p)]], p.shape) for p in params]
    compute, reduce = (dtype, dtype) if packed else handle_dtypes(cfg.mixed_precision, dtype, fp32)
    shard_device = torch.device("cpu") if cfg.cpu_offload else device
    handle = FlatParamHandle(slots, mesh, dtype, requires_grad, device, compute, reduce, shard_device,
                             label=label, timeout_s=comm.default_timeout_s(cfg.timeout_s),
                             quantization=None if packed else cfg.quantization, offload=offload, packed=packed)
    if scatter:
        _scatter_from_rank0(handle, values, mesh)
    else:
        for slot, value in zip(slots, values):
            handle.fill_from_full(slot, value)
    return handle


def handle_dtypes(mp, dtype: torch.dtype, fp32: bool = False) -> tuple[torch.dtype, torch.dtype]:
    """(compute, reduce) dtype of a flat handle whose master dtype is ``dtype`` under MixedPrecision ``mp``
    (None: no mixed precision); ``fp32``: an fp32 module's handle, gathered, computed and reduced in float32
    (or wider). Non-floating handles keep their dtype. Shared with ``fp.plan``."""
    if mp is None or not dtype.is_floating_point:
        return dtype, dtype
    if fp32:
        wide = dtype if dtype.itemsize > 4 else torch.float32
        return wide, wide
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


def _finish_buffers(model: nn.Module, cfg: ShardingConfig, mesh: Mesh, device, keep: set) -> None:
    """Move buffers to the device, cast to buffer_dtype (except ``keep``: ``(id(module), name)`` of the fp32
    modules' buffers), and make rank 0's values everyone's."""
    bdtype = cfg.mixed_precision.buffer_dtype if cfg.mixed_precision else None
    seen: set[int] = set()
    for m in model.modules():
        for n, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.device != device:
                m._buffers[n] = b = b.to(device)
            if bdtype is not None and b.is_floating_point() and (id(m), n) not in keep:
                m._buffers[n] = b = b.to(bdtype)
            if mesh.world_size > 1 and id(b) not in seen:
                comm.broadcast(b, src=0, group=None)
            seen.add(id(b))
