"""What the rest of the engine needs to know about experts under expert parallelism (a leaf module: the flat
layout, norms and checkpoints import it): the spec recorded on each experts parameter, the experts' mesh, and the
all-gather that turns local experts into the global tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._comm import collectives as comm
from .._groups import mesh as _mesh
from .._groups.mesh import Mesh


@dataclass(frozen=True)
class EPSpec:
    """How an experts parameter's local tensor (this EP rank's experts) sits in the global ``[num_experts, ...]``
    tensor: ``shape`` the global shape, ``offset`` the global index of the local tensor's first element on every
    dim (``(ep_rank * E_local, 0, ...)``), ``mesh`` the experts' `ExpertMesh` (its EP group gathers the global
    tensor). ``owner``: for one expert's own parameter (the per-expert ``ModuleList`` form, ``per_expert.py``),
    the EP rank holding it whole; every other EP rank holds an empty box (``(0, *shape[1:])``). None: a fused
    ``[num_experts, ...]`` tensor, one slice per EP rank."""

    shape: torch.Size
    offset: tuple
    mesh: "ExpertMesh"
    owner: Optional[int] = None


def ep_spec(p) -> Optional[EPSpec]:
    """The EP spec ``fp.shard`` recorded on parameter ``p`` (None: not an experts parameter under EP)."""
    return getattr(p, "_fp_ep", None)


@dataclass(frozen=True)
class ExpertMesh(Mesh):
    """The mesh of the experts' flat handles: the shard group is efsdp (``S / E`` ranks), the replicate group
    the dense one. ``dense`` is the unit's ordinary mesh; ``ep_size``/``ep_rank`` this rank's EP coordinate."""

    dense: Optional[Mesh] = None
    ep_size: int = 1
    ep_rank: int = 0
    group_key: tuple = ()

    @property
    def reduce_world(self) -> int:
        """Gradients are averaged over every data-parallel rank (the dense count), not over efsdp."""
        return self.dense.reduce_world

    def ep_global_rank(self, ep_rank: int) -> int:
        """The global rank of EP rank ``ep_rank`` of this rank's EP group (E consecutive ranks of its shard row)."""
        row = next(r for r in self.dense.shard_rows if self.rank in r)
        return row[self.dense.shard_rank // self.ep_size * self.ep_size + ep_rank]

    @property
    def ep_group(self):
        return _mesh._GROUP_CACHE[self.group_key][0]


def full_tensor(local: torch.Tensor, spec: EPSpec) -> torch.Tensor:
    """The global ``[num_experts, ...]`` tensor from every EP rank's local experts (collective over the EP
    group: every rank of it calls it, for the same parameters in the same order). A per-expert parameter
    (``spec.owner`` set) comes from its owner by a broadcast over the EP group."""
    out = torch.empty(spec.shape, dtype=local.dtype, device=local.device)
    if spec.owner is not None:
        if spec.mesh.ep_rank == spec.owner:
            out.copy_(local.detach())
        comm.broadcast(out, src=spec.mesh.ep_global_rank(spec.owner), group=spec.mesh.ep_group, kind="state_dict",
                       what="one expert's parameter from its EP rank")
        return out
    comm.all_gather(out.view(-1), local.detach().contiguous().view(-1), spec.mesh.ep_group, kind="state_dict",
                    what="experts to their global tensor")
    return out
