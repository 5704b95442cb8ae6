"""Read-only view of how a model's parameters are laid out across ranks (for checkpoints/integrations)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .._experts.spec import EPSpec, ep_spec
from .dtensor import tp_spec
from .rows import row_numel


@dataclass(frozen=True)
class ParamShard:
    """This rank's piece of one parameter: the flattened full parameter's elements ``[start, end)``."""

    fqn: str
    aliases: tuple
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int
    writer: bool
    # tensor-parallel parameter: ``shape`` is the global shape, [start, end) a range of the flattened LOCAL TP
    # tensor, and this is the piece as a box of the global tensor, ``(offsets, sizes)`` (None: not TP)
    box: Optional[tuple] = None


@dataclass(frozen=True)
class ParamInfo:
    """Where a parameter of a sharded model lives (``fp.param_info``). Ranks are global ranks; with
    hybrid_shard, ``owner`` is the owner inside this rank's shard group (every replica has its own)."""

    fqn: str
    shape: torch.Size       # the full parameter's shape (``p.shape`` is this rank's piece)
    owner: int              # the rank holding it whole, or the rank fp.optim.Muon orthogonalizes it on
    start: int              # this rank's piece is the flattened parameter's elements [start, end)
    end: int
    split: bool             # cut between ranks (no rank holds it whole)


def param_info(p: nn.Parameter) -> ParamInfo:
    """Full shape, owner rank and this rank's piece of ``p`` (a parameter of a model sharded by fp.shard).
    A parameter fp.shard does not manage is reported whole on this rank."""
    h = getattr(p, "_fp_handle", None)
    if h is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return ParamInfo("", p.shape, rank, 0, p.numel(), False)
    i = next(i for i, s in enumerate(h.slots) if s.param is p)
    slot, n = h.slots[i], h.mesh.shard_size
    split = 0 < slot.numel and all(hi - lo < slot.numel for lo, hi in (h.piece_of(slot, j) for j in range(n)))
    owner = shard_group_ranks(h.mesh)[h.owners[i]]
    return ParamInfo(slot.fqn, slot.shape, owner, slot.local_start, slot.local_end, split)


def shard_group_ranks(mesh) -> list[int]:
    """Global rank of every shard rank of this rank's shard group, in shard-rank order."""
    if mesh.shard_size == 1:
        return [mesh.rank]
    if mesh.shard_group is None or mesh.shard_group is dist.group.WORLD:
        return list(range(mesh.world_size))
    return list(dist.get_process_group_ranks(mesh.shard_group))


@dataclass(frozen=True)
class ShardingInfo:
    strategy: str
    world_size: int
    rank: int
    shard_size: int
    replicate_size: int
    timeout_s: Optional[float] = None   # ShardingConfig.timeout_s (None: FSDP_PLUGIN_TIMEOUT_S / 480 s)
    tp_size: int = 1                    # tensor-parallel degree (the world is replicate x shard x tp)


def is_persistent_buffer(module: nn.Module, name: str) -> bool:
    """The one rule for which buffers belong to a state dict (and so to checkpoints): registered, not None,
    not ``persistent=False``."""
    return module._buffers.get(name) is not None and name not in module._non_persistent_buffers_set


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


def param_shards(model: nn.Module) -> list[ParamShard]:
    """One entry per distinct parameter, in ``named_parameters()`` order (sharded or plain model)."""
    names = _aliases(model)
    root = getattr(model, "_fp_root", None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp_mesh = getattr(root, "tp_mesh", None)
    out = []
    for fqn, p in model.named_parameters():
        h = getattr(p, "_fp_handle", None)
        alias = tuple(n for n in names[id(p)] if n != fqn)
        if root is None or h is None:
            out.append(ParamShard(fqn, alias, p, p.shape, p.dtype, 0, p.numel(), rank == 0))
            continue
        slot = next(s for s in h.slots if s.param is p)
        spec = tp_spec(p) or ep_spec(p)
        if spec is not None:     # TP or expert-parallel (``_experts/``): a box of the global tensor
            out.append(_tp_shard(fqn, alias, p, slot, spec, h.mesh, tp_mesh))
            continue
        writer = h.mesh.replicate_rank == 0 and (h.mesh.shard_size > 1 or h.mesh.rank == 0)
        if tp_mesh is not None:   # a plain parameter of a TP model: the same on every TP coordinate
            writer = h.mesh.replicate_rank == 0 and h.mesh.shard_rank == 0 if h.mesh.shard_size == 1 else writer
            writer = writer and tp_mesh.get_local_rank() == 0
        out.append(ParamShard(fqn, alias, p, slot.shape, p.dtype, slot.local_start, slot.local_end, writer))
    return out


def _tp_shard(fqn, alias, p, slot, spec, mesh, tp_mesh=None) -> ParamShard:
    """A TP parameter's piece: our rows ``[start, end)`` of the local box, as a box of the global tensor.
    Writers: dp replica 0 (shard rank 0 when unsharded) of every TP coordinate holding a proper part of the
    tensor; a TP-replicated tensor only from TP coordinate 0 (experts under EP x TP are replicated over TP)."""
    local = tuple(slot.shape)
    if (slot.local_start, slot.local_end) == (0, slot.numel) or not local:
        box = (tuple(spec.offset), local)
    else:
        w = row_numel(local)
        row0 = slot.local_start // w
        box = ((spec.offset[0] + row0, *spec.offset[1:]), ((slot.local_end - slot.local_start) // w, *local[1:]))
    dp_writer = mesh.replicate_rank == 0 and (mesh.shard_size > 1 or mesh.shard_rank == 0)
    # every EP rank holds distinct experts (a proper part of the global tensor), as a TP-sharded box does
    if isinstance(spec, EPSpec):
        writer = dp_writer and (tp_mesh is None or tp_mesh.get_local_rank() == 0)
    else:
        writer = dp_writer and (spec.sharded or spec.mesh.get_local_rank() == 0)
    return ParamShard(fqn, alias, p, spec.shape, p.dtype, slot.local_start, slot.local_end, writer, box)


def sharding_info(model: nn.Module) -> ShardingInfo:
    root = getattr(model, "_fp_root", None)
    if root is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return ShardingInfo("none", world, rank, 1, world)
    m = root.mesh
    tp = root.tp_mesh.size() if getattr(root, "tp_mesh", None) is not None else 1
    return ShardingInfo(root.config.sharding_strategy, m.world_size, m.rank, m.shard_size, m.replicate_size,
                        root.config.timeout_s, tp)
