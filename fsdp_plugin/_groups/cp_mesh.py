"""Context parallel on a torch DeviceMesh (issue 54: CP composed with tensor parallel).

The user builds one root mesh ``init_device_mesh(dev, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))``,
parallelizes on ``mesh["tp"]`` and passes ``device_mesh=mesh["dp", "cp"]`` with ``context_parallel=cp``: the
device mesh's LAST dimension is the CP dimension (its size must equal ``context_parallel``); hybrid_shard takes
a 3-D ``mesh["dp_replicate", "dp_shard", "cp"]``. Parameters shard over every dimension but the replicate one
(dp x cp, as shard x cp without a mesh), CP groups are the mesh's cp rows, TP's collectives stay on "tp".

Groups are new ones (``new_group``), not the mesh's: the shard group is dp x cp flattened, which the mesh has
no group for, and the CP group stays apart from the units' tagged traffic as in ``mesh._context_groups``.
``new_group`` orders a group's ranks ascending, so rows are kept sorted and shard ranks read from them.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .. import _compat
from .._build.strategy import ShardScope
from ..errors import ConfigError
from .timeouts import backstop_timeout

RECIPE = ("build init_device_mesh(device, (dp, cp, tp), mesh_dim_names=('dp', 'cp', 'tp')), parallelize on "
          "mesh['tp'] and pass device_mesh=mesh['dp', 'cp'] (hybrid_shard: mesh['dp_replicate', 'dp_shard', 'cp']) "
          "with context_parallel=<the cp size>; or drop the DeviceMesh (no tensor parallel): full_shard, "
          "shard_grad_op, no_shard, or hybrid_shard with device_mesh=(replicate, shard)")


def _slices(mesh) -> list:
    """The rank grid (mesh.shape) of every slice of the root mesh that ``mesh`` is one of, in one order on
    every rank (the slice's own tensor lists only this rank's slice)."""
    root = _compat.root_mesh(mesh)
    if root is mesh:
        return [mesh.mesh]
    names, mine = list(root.mesh_dim_names or ()), list(mesh.mesh_dim_names or ())
    if not mine or any(n not in names for n in mine):
        raise ConfigError(f"context_parallel: device_mesh dims {mesh.mesh_dim_names} are not dims of its root mesh "
                          f"{root.mesh_dim_names} (a flattened or unnamed slice): {RECIPE}")
    keep = [names.index(n) for n in mine]
    other = [i for i in range(len(names)) if i not in keep]
    grid = root.mesh.permute(*other, *keep)
    return list(grid.reshape(-1, *mesh.shape))


def check_shape(scope: ShardScope, mesh, cp: int, world: int, tp_size: int) -> None:
    """Refuse, naming the recipe, a DeviceMesh this module cannot read as (data-parallel dims..., cp)."""
    want = 3 if scope is ShardScope.NODE else 2
    shape = tuple(getattr(mesh, "shape", ()))
    if len(shape) != want or shape[-1] != cp:
        what = "(dp_replicate, dp_shard, cp)" if scope is ShardScope.NODE else "(dp, cp)"
        raise ConfigError(f"context_parallel={cp} with a DeviceMesh of shape {shape} "
                          f"(dims {getattr(mesh, 'mesh_dim_names', None)}): this sharding strategy needs a {want}-D "
                          f"device_mesh {what} whose last dimension is the CP dimension of size {cp}: {RECIPE}")
    if mesh.size() * tp_size != world:
        raise ConfigError(f"context_parallel={cp}: device_mesh {shape} times the tensor-parallel size {tp_size} is "
                          f"not the world of {world} ranks: {RECIPE}")


def build(scope: ShardScope, mesh, cp: int, tp_size: int, timeout_s: Optional[float], cache: dict):
    """(Mesh fields as a dict, for ``mesh.Mesh``) of this rank: shard/replicate/CP groups, shard rows and the
    data-parallel view. ``cache``: the package's group cache (groups are created once per layout)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_shape(scope, mesh, cp, world, tp_size)
    slices = _slices(mesh)
    shard_rows, rep_rows, cp_rows = [], [], []
    for s in slices:
        if scope is ShardScope.WORLD:
            shard_rows.append(s.reshape(-1).tolist())
        elif scope is ShardScope.NONE:
            rep_rows.append(s.reshape(-1).tolist())
        else:
            flat = s.reshape(s.shape[0], -1)
            shard_rows += [r.tolist() for r in flat]
            rep_rows += [flat[:, j].tolist() for j in range(flat.shape[1])]
        cp_rows += [r.tolist() for r in s.reshape(-1, cp)]
    key = ("cp_mesh", scope, tuple(tuple(r) for r in shard_rows + rep_rows + cp_rows))
    if key not in cache:     # entries are pairs of groups, as fp.shutdown's release expects
        shard, rep, cpg = (_mine(rows, rank, timeout_s) for rows in (shard_rows, rep_rows, cp_rows))
        cache[key], cache[(*key, "cp")] = (shard, rep), (cpg, None)
    (shard_group, rep_group), cp_group = cache[key], cache[(*key, "cp")][0]
    shard_rows = [sorted(r) for r in shard_rows]
    shard_of = [0] * world
    for row in shard_rows:
        for j, r in enumerate(row):
            shard_of[r] = j
    my_shard = next((row for row in shard_rows if rank in row), [rank])
    my_rep = next((sorted(row) for row in rep_rows if rank in row), [rank])
    mine = next(s for s in slices if rank in s.reshape(-1).tolist()).reshape(-1, cp)
    dp_rank = next(i for i, row in enumerate(mine.tolist()) if rank in row)
    return dict(world_size=world, rank=rank, shard_size=len(my_shard), shard_rank=my_shard.index(rank),
                replicate_size=len(my_rep), replicate_rank=my_rep.index(rank), shard_group=shard_group,
                replicate_group=rep_group, shard_rank_of=tuple(shard_of),
                shard_rows=tuple(tuple(r) for r in shard_rows), cp_size=cp, cp_group=cp_group,
                dp_view=(mine.shape[0], dp_rank))


def _mine(rows: list, rank: int, timeout_s: Optional[float]):
    """Create every group of ``rows`` (every rank, same order, as new_group requires); return this rank's."""
    out = None
    for row in rows:
        g = dist.new_group(sorted(row), timeout=backstop_timeout(timeout_s))
        if rank in row:
            out = g
    return out
