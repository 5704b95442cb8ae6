"""Sharding strategies as data, and the one place that decides each unit's policy.

A strategy name only selects a row of ``STRATEGIES``: how the mesh is built (``ShardScope``) and the default
``reshard_after_forward``. ``unit_policy`` turns the config into one `UnitPolicy` per unit, so a per-unit
override (``ShardingConfig.reshard_after_forward``) is data, not another string comparison.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional, Sequence

from torch import nn

if TYPE_CHECKING:
    from .._groups.mesh import Mesh
    from ..config import ShardingConfig


class ShardScope(Enum):
    WORLD = "world"      # one shard group of every rank (ZeRO-3 / ZeRO-2)
    NONE = "none"        # no sharding: every rank replicates, gradients all-reduced (DDP-like)
    NODE = "node"        # shard inside a group, replicate across groups (hybrid)


@dataclass(frozen=True)
class Strategy:
    scope: ShardScope
    reshard_after_forward: bool      # default for every unit but the root


STRATEGIES: dict[str, Strategy] = {
    "full_shard": Strategy(ShardScope.WORLD, True),
    "shard_grad_op": Strategy(ShardScope.WORLD, False),
    "no_shard": Strategy(ShardScope.NONE, False),
    "hybrid_shard": Strategy(ShardScope.NODE, True),
}


@dataclass(frozen=True)
class UnitPolicy:
    """How one unit is sharded: over which mesh, and whether forward frees its full parameters."""

    mesh: "Mesh"
    reshard_after_forward: bool


def reshard_after_forward_table(cfg: "ShardingConfig", policies: Sequence[bool],
                                order: Optional[Sequence[int]] = None) -> list[bool]:
    """THE answer to "does unit i free its full parameters after its forward?", for every unit (index 0: root).

    ``policies[i]``: unit i's ``UnitPolicy.reshard_after_forward`` (the config's rule; the root never). ``order``:
    the frozen forward order (unit indices) once the first forward recorded it, else None. Under the default
    policy (``cfg.reshard_after_forward is None``) the last unit in forward order keeps its parameters: its
    backward comes first (the root's pre-backward prefetches it), so resharding it would only all-gather it again
    at once (torchtitan keeps its last block the same way); an explicit ``reshard_after_forward`` is obeyed."""
    table = list(policies)
    if order and cfg.reshard_after_forward is None and order[-1] != 0:
        table[order[-1]] = False
    return table


def unit_policy(cfg: "ShardingConfig", mesh: "Mesh", fqn: str, module: nn.Module) -> UnitPolicy:
    """The root unit (``fqn == ""``) never reshards after forward: backward needs it first (FSDP2 does the
    same). Others follow ``cfg.reshard_after_forward`` (None: the strategy's default; a bool; module classes
    that reshard; or ``callable(fqn, module) -> bool``)."""
    if fqn == "":
        return UnitPolicy(mesh, False)
    rule = cfg.reshard_after_forward
    if rule is None:
        value = STRATEGIES[cfg.sharding_strategy].reshard_after_forward
    elif isinstance(rule, bool):
        value = rule
    elif isinstance(rule, int):       # hpZ (``secondary_size``): 1 keeps the full parameters, as False does
        value = rule != 1
    elif isinstance(rule, (set, frozenset, tuple, list)):
        value = isinstance(module, tuple(rule))
    else:
        value = bool(rule(fqn, module))
    return UnitPolicy(mesh, value)


def secondary_size(cfg: "ShardingConfig", shard_size: int) -> int:
    """hpZ's secondary group size for ``reshard_after_forward=<int r>``: r when 1 < r < shard_size, else 0 (1 is
    False, the shard size is True: no secondary shard). Raises when r does not divide the shard group."""
    from ..errors import ConfigError
    rule = cfg.reshard_after_forward
    if not isinstance(rule, int) or isinstance(rule, bool) or shard_size == 1:
        return 0
    if shard_size % rule:
        raise ConfigError(f"reshard_after_forward={rule} does not divide the shard group of {shard_size} ranks "
                          f"({cfg.sharding_strategy}): use a divisor of {shard_size}, typically the ranks per node "
                          f"(LOCAL_WORLD_SIZE), or True/False")
    return rule if 1 < rule < shard_size else 0


@dataclass(frozen=True)
class PrefetchDepth:
    """Units all-gathered ahead of the one in use, in forward and in backward order (0: no prefetch)."""

    forward: int
    backward: int


def prefetch_depth(cfg: "ShardingConfig") -> PrefetchDepth:
    """The public switches as numbers: ``limit_all_gathers`` bounds unsharded units to the one in use plus one in
    flight (besides the root), without it two are prefetched (more overlap, more memory); ``forward_prefetch`` /
    ``backward_prefetch`` off is depth 0 in that direction."""
    depth = 1 if cfg.limit_all_gathers else 2
    return PrefetchDepth(depth if cfg.forward_prefetch else 0, depth if cfg.backward_prefetch else 0)
