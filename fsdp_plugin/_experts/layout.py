"""Where experts live under ``expert_parallel=E``: groups, the experts' mesh, and each rank's box.

Layout (dp2ep): inside every data-parallel shard group of S ranks (shard ranks ``0..S-1``), EP coordinate
``shard_rank % E`` and expert-shard coordinate ``shard_rank // E``. An EP group is E consecutive shard ranks (on
NCCL: neighbouring GPUs); it holds every expert of a layer once, EP rank ``i`` owning experts
``[i*E_local, (i+1)*E_local)`` with ``E_local = num_experts / E``. Those local experts are flat-sharded over the
``S / E`` ranks sharing the EP coordinate ("efsdp"), replicated across hybrid's replicas as everything else.
So each expert element is held once per shard group, as a dense element is: norms and checkpoints count it
once there (``fp.clip_grad_norm_``, ``_flat/layout.py``).

Gradients: after backward's reverse all-to-all, a rank's local-expert gradient is already the sum over its EP
group's tokens; the expert handle sums it over efsdp (and replicas) and divides by the data-parallel count
``S * R``, never by ``S / E`` (`ExpertMesh.reduce_world`): every rank's loss is its own batch's mean, as for
dense parameters.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .._groups import mesh as _mesh
from .._groups.mesh import Mesh
from ..errors import ConfigError
from . import aux_loss
from .detect import check_experts
from .dispatch import install
from .per_expert import install as install_per_expert
from .spec import EPSpec, ExpertMesh, ep_spec


def _groups(mesh: Mesh, ep: int, timeout_s=None) -> tuple:
    """(EP group, efsdp group) of this rank; every rank creates every group in the same order (new_group is
    collective over the world). The efsdp group is None when it has one rank."""
    key = ("experts", mesh.shard_rows, ep)
    if key not in _mesh._GROUP_CACHE:
        mine_ep = mine_ef = None
        for row in mesh.shard_rows:
            for i in range(0, len(row), ep):
                ranks = list(row[i:i + ep])
                g = dist.new_group(ranks, timeout=_mesh.backstop_timeout(timeout_s))
                if mesh.rank in ranks:
                    mine_ep = g
        if mesh.shard_size > ep:
            for row in mesh.shard_rows:
                for j in range(ep):
                    ranks = list(row[j::ep])
                    g = dist.new_group(ranks, timeout=_mesh.backstop_timeout(timeout_s))
                    if mesh.rank in ranks:
                        mine_ef = g
        _mesh._GROUP_CACHE[key] = (mine_ep, mine_ef)
    return key


def expert_mesh(mesh: Mesh, ep: int, timeout_s=None) -> ExpertMesh:
    key = _groups(mesh, ep, timeout_s)
    ef_rows = tuple(tuple(row[j::ep]) for row in mesh.shard_rows for j in range(ep))
    ef_rank_of = [0] * mesh.world_size
    for row in mesh.shard_rows:
        for pos, r in enumerate(row):
            ef_rank_of[r] = pos // ep
    out = ExpertMesh(mesh.world_size, mesh.rank, mesh.shard_size // ep, mesh.shard_rank // ep, mesh.replicate_size,
                     mesh.replicate_rank, shard_group=_mesh._GROUP_CACHE[key][1],
                     replicate_group=mesh.replicate_group, shard_rank_of=tuple(ef_rank_of), shard_rows=ef_rows,
                     dense=mesh, ep_size=ep, ep_rank=mesh.shard_rank % ep, group_key=key)
    _mesh._LIVE_MESHES[id(out)] = out     # fp.shutdown forgets its groups with the others'
    return out


def prepare(model: nn.Module, cfg, mesh: Mesh, device: torch.device, tp_mesh=None) -> Optional[ExpertMesh]:
    """For ``cfg.expert_parallel`` > 1: refuse what cannot work, build the groups, cut every experts parameter to
    this rank's experts (``p._fp_ep``) and wrap every experts module's forward (``dispatch.py``); the experts'
    `ExpertMesh`. None (nothing done) when expert parallelism is off. ``tp_mesh``: the model's tensor-parallel
    DeviceMesh (None: no TP); ``mesh`` is then one TP coordinate's data-parallel mesh, the EP groups lie inside
    it, and the experts must be whole on every TP rank (``refuse_tp_experts``)."""
    ep = cfg.expert_parallel
    if ep is None or ep == 1:
        return None
    refuse_combinations(cfg)
    found, per_expert = check_experts(model, ep, mesh.shard_size, cfg.sharding_strategy)
    if tp_mesh is not None:
        refuse_tp_experts(found, per_expert, ep)
    emesh = expert_mesh(mesh, ep, cfg.timeout_s)   # process-group timeouts past the deadline (``_groups/timeouts``)
    rank0_values = _rank0_values(model, mesh, device)
    sites = _sites(model)
    for name, module in found:
        local = module.num_experts // ep
        lo = emesh.ep_rank * local
        for attr, p in list(module._parameters.items()):
            if p is None or ep_spec(p) is not None:     # already cut (a tied parameter seen again)
                continue
            full = _full_value(p, f"{name}.{attr}", rank0_values, mesh, device)
            q = _new_param(p, full[lo:lo + local].clone() if not full.is_meta else full[lo:lo + local])
            q._fp_ep = EPSpec(p.shape, (lo,) + (0,) * (p.dim() - 1), emesh)
            _replace(sites, p, q)
        module.num_experts = local      # the model's own experts code indexes its local experts 0..local-1
        install(module, emesh, name, cfg.expert_capacity_factor)
    for name, block, container in per_expert:    # one module per expert: whole on its EP rank, empty elsewhere
        experts = list(container.children())
        local = len(experts) // ep
        for i, expert in enumerate(experts):
            owner = i // local
            for sub, m in expert.named_modules():
                for attr, p in list(m._parameters.items()):
                    if p is None or ep_spec(p) is not None:     # already cut (a tied parameter seen again)
                        continue
                    full = _full_value(p, f"{name}.{i}.{sub}.{attr}", rank0_values, mesh, device)
                    mine = full.clone() if not full.is_meta else full
                    q = _new_param(p, mine if owner == emesh.ep_rank else full.new_empty((0, *p.shape[1:])))
                    q._fp_ep = EPSpec(p.shape, (0,) * p.dim(), emesh, owner=owner)
                    _replace(sites, p, q)
        install_per_expert(block, container, emesh, name, cfg.expert_capacity_factor)
    # the router's aux loss on the global batch (``aux_loss.py``). Under TP the world holds each data-parallel
    # rank's logits tp times: its batch means are unchanged, and the gather's backward sums tp copies of a
    # gradient 1/tp as large (exact, tested; tp times the bytes of a gather over the ranks of one TP coordinate)
    aux_loss.install(model, _world_group(cfg.timeout_s))
    return emesh


def _full_value(p: nn.Parameter, name: str, rank0_values: bool, mesh: Mesh, device) -> torch.Tensor:
    """``p``'s whole value: rank 0's when every rank takes rank 0's values, as for dense parameters
    (``_build/shard.py``)."""
    full = p.detach()
    if rank0_values:
        full = full if mesh.rank == 0 else torch.empty(p.shape, dtype=p.dtype, device=device)
        full = full.to(device)
        comm.broadcast(full, src=0, group=None, what=f"experts {name} from rank 0")
    return full


def _new_param(p: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    q = nn.Parameter(data, requires_grad=p.requires_grad)
    q.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_param"})
    return q


def _world_group(timeout_s=None):
    """A group of every rank, the experts' own (the global aux loss gathers router logits on it, so its calls never
    interleave with the units' collectives on the default group)."""
    key = ("experts", "world")
    if key not in _mesh._GROUP_CACHE:
        _mesh._GROUP_CACHE[key] = (dist.new_group(list(range(dist.get_world_size())),
                                                  timeout=_mesh.backstop_timeout(timeout_s)), None)
    return _mesh._GROUP_CACHE[key][0]


def refuse_tp_experts(found: list, per_expert: list, ep: int) -> None:
    """Under EP x TP the experts are replicated over TP (each TP rank runs its EP group's experts whole on the
    tokens its TP group shares): an experts parameter the TP plan split or replicated as a DTensor is refused."""
    from .._flat.dtensor import tp_spec
    modules = [(n, m) for n, m in found] + [(n, c) for n, _, c in per_expert]
    for name, m in modules:
        split = [pn for pn, p in m.named_parameters() if tp_spec(p) is not None]
        # transformers marks every module its plan touched (moe_tp_experts: an all-reduce of the experts' output)
        split += [f"{sub}.forward" if sub else "forward" for sub, s in m.named_modules()
                  if getattr(s, "_is_hooked", False)
                  or "install_forward" in getattr(s.__dict__.get("forward"), "__qualname__", "")]
        if split:
            raise ConfigError(f"expert_parallel={ep} with tensor parallel: {name}.{split[0]} is in the TP plan; "
                              "under EP x TP the experts stay whole on every TP rank (EP splits them over the "
                              "data-parallel ranks): leave the experts' entries (and moe_tp_experts) out of the "
                              "plan, e.g. {k: v for k, v in model.tp_plan.items() if '.experts' not in k}")


def refuse_combinations(cfg) -> None:
    """The configurations expert_parallel does not combine with yet (fp.plan refuses the same ones)."""
    rule = cfg.reshard_after_forward
    if isinstance(rule, int) and not isinstance(rule, bool) and rule > 1:
        raise ConfigError(f"expert_parallel={cfg.expert_parallel} with reshard_after_forward={rule} (hpZ): not "
                          "supported together yet; use reshard_after_forward=True/False/None")
    if cfg.quantization is not None and cfg.quantization.enabled:
        raise ConfigError(f"expert_parallel={cfg.expert_parallel} with quantization: not supported together yet; "
                          "drop one of them")


def _rank0_values(model: nn.Module, mesh: Mesh, device) -> bool:
    """Rank 0's model is real and every rank takes its values (``decide_scatter``); deferred models refused."""
    from .._materialize.materialize import DEFERRED, decide_scatter, model_kind
    if model_kind(model) == DEFERRED:
        raise ConfigError("expert_parallel with a model built under fp.deferred_init(): not supported yet; build it "
                          "on the meta device (torch.device('meta')) and fill it with fp.load_pretrained / "
                          "fp.load_checkpoint, or build it on every rank")
    return decide_scatter(model, mesh.world_size, device)


def _sites(model: nn.Module) -> dict:
    """``id(parameter) -> [(module, attr)]`` for every registration (tied parameters have several), built once:
    a model with thousands of per-expert parameters would make a scan per parameter quadratic."""
    out: dict = {}
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, attr))
    return out


def _replace(sites: dict, old: nn.Parameter, new: nn.Parameter) -> None:
    for m, attr in sites.pop(id(old), ()):
        m._parameters[attr] = new


def split_expert_params(params: list) -> tuple[list, list]:
    """A unit's parameters as (dense, experts): experts get their own flat handles on the `ExpertMesh`."""
    return [p for p in params if ep_spec(p) is None], [p for p in params if ep_spec(p) is not None]

