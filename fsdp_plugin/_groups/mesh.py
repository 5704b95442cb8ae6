"""Process groups for each strategy: a shard group (parameters are chunked across it) and a replicate
group (shards are all-reduced across it). World size 1, or no process group at all, needs neither."""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .. import _compat
from .._build.strategy import ShardScope
from .._comm import native, nodes
from ..errors import ConfigError
from . import cp_mesh
from .timeouts import backstop_timeout

_GROUP_CACHE: dict = {}
# every mesh built, by id (Mesh compares by value, so no WeakSet), so that fp.shutdown can drop their groups
_LIVE_MESHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Mesh:
    world_size: int
    rank: int
    shard_size: int
    shard_rank: int
    replicate_size: int
    replicate_rank: int
    shard_group: object = None       # None means the default group (or no distribution at all)
    replicate_group: object = None
    shard_rank_of: tuple = (0,)      # shard rank of every global rank
    shard_rows: tuple = ()           # global ranks of every shard group, in shard-rank order (all groups)
    # context parallel (ShardingConfig.context_parallel): groups of cp_size consecutive ranks that split one
    # sample's sequence; their gradients are partial sums of the same samples' gradient
    cp_size: int = 1
    cp_group: object = None
    # (size, rank) of the data-parallel view when the CP groups come from a DeviceMesh (``cp_mesh.py``: with
    # tensor parallel the world also counts TP ranks, so rank // cp_size is not the batch index); () otherwise
    dp_view: tuple = ()

    @property
    def reduce_world(self) -> int:
        """The divisor of the summed gradients: the number of data-parallel ranks (distinct batches). A
        context-parallel group holds the partial gradients of ONE batch, so its cp_size ranks count once:
        the reduction sums over cp and averages over dp."""
        return self.shard_size * self.replicate_size // self.cp_size

    @property
    def dp_size(self) -> int:
        """Ranks with distinct batches (what samplers split the data over)."""
        return self.dp_view[0] if self.dp_view else self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.dp_view[1] if self.dp_view else self.rank // self.cp_size


def build_mesh(scope: ShardScope, device_mesh, tp_size: int = 1, timeout_s: Optional[float] = None,
               cp_size: int = 1) -> Mesh:
    """The mesh of a strategy's ``ShardScope`` (see ``_strategy.STRATEGIES``); ``tp_size``: the tensor-parallel
    dimension a DeviceMesh ``device_mesh`` leaves out (its size times ``tp_size`` is the world); ``timeout_s``:
    the deadline (``ShardingConfig.timeout_s``) the groups created here outlast (``timeouts.py``); ``cp_size``:
    context-parallel groups of consecutive ranks inside the shard group (``_context_groups``)."""
    if not dist.is_initialized():
        if cp_size > 1:
            raise ConfigError(f"context_parallel={cp_size} needs {cp_size} ranks: initialize the process group "
                              "(torchrun) first, or drop context_parallel")
        return Mesh(1, 0, 1, 0, 1, 0)
    if cp_size > 1 and device_mesh is not None and not isinstance(device_mesh, tuple):
        # (dp..., cp) DeviceMesh, tensor parallel or not (``cp_mesh.py``)
        mesh = Mesh(**cp_mesh.build(scope, device_mesh, cp_size, tp_size, timeout_s, _GROUP_CACHE))
    else:
        mesh = _build(scope, device_mesh, tp_size, timeout_s)
    if cp_size > 1 and mesh.cp_group is None:
        mesh = _with_context_parallel(mesh, scope, device_mesh, tp_size, cp_size, timeout_s)
    _ensure_control_group(timeout_s)
    _LIVE_MESHES[id(mesh)] = mesh
    return mesh


def _ensure_control_group(timeout_s: Optional[float] = None) -> None:
    """A gloo group of every rank that carries the pairing announcements (``_comm.pairing``) and nothing else;
    created here, where every rank is in fp.shard (new_group is collective), once per process group."""
    if "control" not in _GROUP_CACHE:
        # torch's fake group cannot host a gloo group (its store is not a rendezvous): its own world group
        # carries the (no-op) control traffic, and pairing is off there (``root.pairing_mode``)
        group = dist.group.WORLD if native.is_fake() else \
            dist.new_group(backend="gloo", timeout=backstop_timeout(timeout_s))
        _GROUP_CACHE["control"] = (group, None)


def control_group():
    """The pairing group (``_ensure_control_group``): gloo, so that reading a verdict never waits for a GPU,
    and of its own, so that announcements still in flight after a divergence can pair with nothing but the
    announcements of fp.reset's re-alignment (``pairing.realign``)."""
    return _GROUP_CACHE.get("control", (None, None))[0]


def release_groups() -> None:
    """After the process groups are destroyed (fp.shutdown): forget every reference this package holds to
    them, so that their C++ threads are joined now. Sharded models cannot communicate afterwards."""
    _GROUP_CACHE.clear()
    nodes.forget()
    for mesh in list(_LIVE_MESHES.values()):
        object.__setattr__(mesh, "shard_group", None)
        object.__setattr__(mesh, "replicate_group", None)
        object.__setattr__(mesh, "cp_group", None)
    _LIVE_MESHES.clear()


def referenced_groups() -> list:
    """The process groups held by live meshes and the sub-group cache (for fp.shutdown's check)."""
    groups = [g for pair in _GROUP_CACHE.values() for g in pair]
    groups += [g for m in _LIVE_MESHES.values() for g in (m.shard_group, m.replicate_group, m.cp_group)]
    return [g for g in groups if g is not None]


def _with_context_parallel(mesh: Mesh, scope: ShardScope, device_mesh, tp_size: int, cp: int,
                           timeout_s: Optional[float] = None) -> Mesh:
    """``mesh`` (no DeviceMesh) with its context-parallel groups: ``cp`` consecutive ranks each (cp innermost),
    inside one shard group, so that parameters shard over shard x cp and a CP group's ranks share a node under
    torchrun. A DeviceMesh names its CP dimension instead (``cp_mesh.py``)."""
    import dataclasses
    if tp_size > 1:     # unreachable through fp.shard (a TP model needs a DeviceMesh); kept for direct callers
        raise ConfigError(f"context_parallel={cp} with tensor parallel needs the CP dimension in device_mesh: "
                          + cp_mesh.RECIPE)
    if mesh.world_size % cp:
        raise ConfigError(f"context_parallel={cp} does not divide the world of {mesh.world_size} ranks: world = "
                          f"data-parallel x context-parallel; use a divisor of {mesh.world_size}")
    if scope is not ShardScope.NONE and mesh.shard_size % cp:
        raise ConfigError(f"context_parallel={cp} does not divide the shard group of {mesh.shard_size} ranks "
                          f"(hybrid_shard device_mesh=(replicate, shard)): parameters shard over shard x cp, so "
                          f"choose a shard size that {cp} divides")
    return dataclasses.replace(mesh, cp_size=cp, cp_group=_context_groups(mesh.world_size, cp, timeout_s))


def _context_groups(world: int, cp: int, timeout_s: Optional[float] = None):
    """This rank's context-parallel group (``cp`` consecutive ranks). A group of its own even when it equals
    the shard group, so that attention's collectives never share a group with the units' tagged traffic.
    Every rank creates every group in the same order, as new_group requires."""
    key = ("cp", world, cp)
    if key not in _GROUP_CACHE:
        rank, mine = dist.get_rank(), None
        for i in range(world // cp):
            g = dist.new_group(list(range(i * cp, (i + 1) * cp)), timeout=backstop_timeout(timeout_s))
            if rank // cp == i:
                mine = g
        _GROUP_CACHE[key] = (mine, None)
    return _GROUP_CACHE[key][0]


def _build(scope: ShardScope, device_mesh, tp_size: int = 1, timeout_s: Optional[float] = None) -> Mesh:
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_mesh is not None and not isinstance(device_mesh, tuple):
        return _from_device_mesh(scope, world, rank, device_mesh, tp_size)
    if scope is ShardScope.WORLD:
        return Mesh(world, rank, world, rank, 1, 0, shard_group=dist.group.WORLD, shard_rank_of=tuple(range(world)),
                    shard_rows=(tuple(range(world)),))
    if scope is ShardScope.NONE:
        return Mesh(world, rank, 1, 0, world, rank, replicate_group=dist.group.WORLD, shard_rank_of=(0,) * world)
    return _hybrid_mesh(world, rank, device_mesh, timeout_s)


def mesh_dims(scope: ShardScope, world: int, local_world: int, device_mesh=None) -> tuple[int, int]:
    """(shard_size, replicate_size) of a strategy's scope at ``world`` ranks; hybrid shards over
    ``local_world`` ranks (one node) unless ``device_mesh=(R, S)`` says otherwise. Pure: shared with fp.plan."""
    if scope is ShardScope.WORLD:
        return world, 1
    if scope is ShardScope.NONE:
        return 1, world
    if device_mesh is None:
        replicate, shard = max(world // max(local_world, 1), 1), local_world
    else:
        replicate, shard = device_mesh
    if replicate * shard != world:
        raise ConfigError(f"hybrid_shard mesh (replicate={replicate}, shard={shard}) needs {replicate * shard} ranks "
                          f"but the world has {world}: pass device_mesh=(R, S) with R*S == {world}")
    return shard, replicate


def _hybrid_mesh(world: int, rank: int, device_mesh, timeout_s: Optional[float] = None) -> Mesh:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shard, replicate = mesh_dims(ShardScope.NODE, world, local, device_mesh)
    shard_group, replicate_group = _hybrid_groups(world, replicate, shard, timeout_s)
    return Mesh(world, rank, shard, rank % shard, replicate, rank // shard, shard_group=shard_group,
                replicate_group=replicate_group, shard_rank_of=tuple(r % shard for r in range(world)),
                shard_rows=tuple(tuple(range(i * shard, (i + 1) * shard)) for i in range(replicate)))


def _hybrid_groups(world: int, replicate: int, shard: int, timeout_s: Optional[float] = None):
    """Shard groups are consecutive ranks (one node under torchrun); replicate groups stride by ``shard``.
    Every rank creates every group in the same order, as new_group requires."""
    key = (world, replicate, shard)
    if key not in _GROUP_CACHE:
        rank = dist.get_rank()
        mine_shard = mine_rep = None
        for r in range(replicate):
            g = dist.new_group(list(range(r * shard, (r + 1) * shard)), timeout=backstop_timeout(timeout_s))
            if rank // shard == r:
                mine_shard = g
        for s in range(shard):
            g = dist.new_group(list(range(s, world, shard)), timeout=backstop_timeout(timeout_s))
            if rank % shard == s:
                mine_rep = g
        _GROUP_CACHE[key] = (mine_shard, mine_rep)
    return _GROUP_CACHE[key]


def _from_device_mesh(scope: ShardScope, world: int, rank: int, mesh, tp_size: int) -> Mesh:
    """A torch DeviceMesh: 1-D = the shard group (full_shard, shard_grad_op) or the replicate group (no_shard);
    2-D = (replicate, shard) of hybrid_shard. With tensor parallelism it is the data-parallel slice of a root
    mesh whose other dimension is TP (``tp_size``)."""
    ndim = getattr(mesh, "ndim", None)
    if ndim not in (1, 2) or (ndim == 2) != (scope is ShardScope.NODE):
        want = "a 2-D DeviceMesh with dims (replicate, shard)" if scope is ShardScope.NODE else \
            "a 1-D DeviceMesh (a 2-D (replicate, shard) one means sharding_strategy='hybrid_shard')"
        raise ConfigError(f"this sharding strategy needs {want}, got {ndim if ndim is not None else type(mesh).__name__}"
                          " dims")
    if mesh.size() * tp_size != world:
        extra = "" if tp_size > 1 else (": a DeviceMesh smaller than the world is only for a tensor-parallel model "
                                        "(parallelize_module on the other dimension of the same root mesh)")
        raise ConfigError(f"DeviceMesh {tuple(mesh.shape)} does not cover the world of {world} ranks{extra}")
    coord, rows = _shard_coordinates(mesh, world)
    if ndim == 1:
        group, size, me = mesh.get_group(0), mesh.size(), mesh.get_local_rank()
        # tensor parallel: the ranks of a TP group share one batch; samplers split over this DeviceMesh only
        view = (size, me) if tp_size > 1 else ()
        if scope is ShardScope.NONE:
            return Mesh(world, rank, 1, 0, size, me, replicate_group=group, shard_rank_of=(0,) * world, dp_view=view)
        return Mesh(world, rank, size, me, 1, 0, shard_group=group, shard_rank_of=coord, shard_rows=rows,
                    dp_view=view)
    replicate, shard = mesh.shape
    rep_group, shard_group = mesh.get_group(0), mesh.get_group(1)
    shard_rank, rep_rank = dist.get_rank(shard_group), dist.get_rank(rep_group)
    view = (replicate * shard, rep_rank * shard + shard_rank) if tp_size > 1 else ()
    return Mesh(world, rank, shard, shard_rank, replicate, rep_rank, shard_group=shard_group,
                replicate_group=rep_group, shard_rank_of=coord, shard_rows=rows, dp_view=view)


def _shard_coordinates(mesh, world: int) -> tuple:
    """Shard rank of every global rank (its coordinate on the mesh's last dimension) and the global ranks of
    every shard group, read in the root mesh (a slice's own tensor lists only the ranks of this rank's slice)."""
    root = _compat.root_mesh(mesh)
    names, last = root.mesh_dim_names or (), (mesh.mesh_dim_names or (None,))[-1]
    grid = mesh.mesh if root is mesh or last not in names else root.mesh.movedim(names.index(last), -1)
    out, rows = [0] * world, grid.reshape(-1, grid.shape[-1]).tolist()
    for row in rows:
        for j, r in enumerate(row):
            out[r] = j
    return tuple(out), tuple(tuple(row) for row in rows)


def secondary_group(mesh: Mesh, size: int, timeout_s: Optional[float] = None):
    """hpZ's secondary group of this rank: ``size`` consecutive ranks of its shard group (every rank creates
    every such group of every shard group, in the same order, as new_group requires); cached."""
    key = ("secondary", mesh.shard_rows, size)
    if key not in _GROUP_CACHE:
        mine = None
        for row in mesh.shard_rows:
            for i in range(0, len(row), size):
                ranks = list(row[i:i + size])
                g = dist.new_group(ranks, timeout=backstop_timeout(timeout_s))
                if mesh.rank in ranks:
                    mine = g
        _GROUP_CACHE[key] = (mine, None)
    return _GROUP_CACHE[key][0]
