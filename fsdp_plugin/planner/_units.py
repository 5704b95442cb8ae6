"""The units `fp.shard` would build, found with the engine's own wrap-policy code (no allocation)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from .._build.precision import fp32_param_ids, fp32_regions
from .._build.shard import group_params
from .._flat import packed_quantize
from .._flat.packed import carrier_shape
from .._build.wrap import params_by_unit, select_unit_modules, some_ranks_fqns
from .._flat.rows import row_aligned_offsets


@dataclass
class HandleSpec:
    """One flat buffer: the parameters of one unit sharing (dtype, requires_grad, fp32), in order."""

    unit: int                 # index into the unit list
    dtype: torch.dtype        # master (shard) dtype
    requires_grad: bool
    numel: int                # unpadded elements
    param_ids: list = field(default_factory=list)
    largest: int = 0          # elements of its largest parameter
    shapes: list = field(default_factory=list)   # every parameter's shape, in layout order
    fp32: bool = False        # an fp32 module's parameters (MixedPrecision.fp32_modules): float32 compute
    ep: int = 1               # expert_parallel=E: an experts handle (local shapes, sharded over shard_size / E)
    packed: bool = False      # quantized bytes (``_flat/packed.py``): gathered and kept in their storage dtype

    def padded(self, shard_size: int) -> int:
        """Flat buffer length with the engine's row-aligned layout (gaps and tail padding included)."""
        if not self.shapes:
            return -(-self.numel // shard_size) * shard_size
        return _padded(tuple(self.shapes), shard_size)

    def chunk(self, shard_size: int) -> int:
        return self.padded(shard_size) // shard_size


@functools.lru_cache(maxsize=4096)
def _padded(shapes: tuple, shard_size: int) -> int:
    return row_aligned_offsets(shapes, shard_size)[1]


@dataclass
class UnitSpec:
    fqn: str
    module: nn.Module
    handles: list = field(default_factory=list)   # indices into the handle list
    some_ranks: bool = False     # ShardingConfig.some_ranks_modules: held from the root's pre-forward to the end

    @property
    def name(self) -> str:
        return self.fqn or "<root>"


def discover_units(model: nn.Module, policy, ignored=(), mp=None, some_ranks_rule=None,
                   experts: dict = None, ep: int = 1) -> tuple[list[UnitSpec], list[HandleSpec]]:
    """Units root first (as fp.shard orders them) and their handles, grouped (and given their master dtype,
    ``mp`` the MixedPrecision) exactly like fp.shard; ``some_ranks_rule``: ``ShardingConfig.some_ranks_modules``.
    ``experts`` ({id(parameter): True} of the experts modules' parameters) with ``ep`` > 1: as fp.shard under
    ``expert_parallel`` (``_build/shard.py``), each unit's experts parameters get their own handles after the
    dense ones, of this rank's ``num_experts / ep`` experts (``HandleSpec.ep``)."""
    experts = experts if ep > 1 else {}
    some = set(some_ranks_fqns(model, some_ranks_rule, ignored))
    chosen = select_unit_modules(model, policy, ignored, some)
    sites, _, owned = params_by_unit(model, [f for f, _ in chosen], ignored)
    fp32_ids = fp32_param_ids(model, mp, fp32_regions(model, mp), sites)
    units, handles = [], []
    for i, (fqn, module) in enumerate(chosen):
        unit = UnitSpec(fqn, module, some_ranks=fqn in some)
        dense = [p for p in owned[fqn] if id(p) not in experts]
        local = [p for p in owned[fqn] if id(p) in experts]
        for group, e in ((dense, 1), (local, ep)):
            for (dtype, rg, fp32, packed), params in group_params(group, mp, fp32_ids).items():
                shapes = [(p.shape[0] // e,) + tuple(p.shape[1:]) if e > 1 else _shape(p) for p in params]
                sizes = [_numel(sh) for sh in shapes]
                unit.handles.append(len(handles))
                handles.append(HandleSpec(i, dtype, rg, sum(sizes), [id(p) for p in params], max(sizes), shapes,
                                          fp32, e, packed))
        units.append(unit)
    return units, handles


def _shape(p) -> tuple:
    """The shape fp.shard will shard: a torchao NF4 weight's uint8 carrier, a pending 4-bit weight's packed
    bytes (``_flat/packed.py``, ``packed_quantize.planned``), else the parameter's."""
    planned = packed_quantize.planned(p)
    return carrier_shape(p) or (planned[0] if planned else tuple(p.shape))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def buffer_bytes(model: nn.Module, buffer_dtype=None) -> int:
    seen, total = set(), 0
    for b in model.buffers():
        if id(b) in seen:
            continue
        seen.add(id(b))
        dtype = buffer_dtype if (buffer_dtype is not None and b.is_floating_point()) else b.dtype
        total += b.numel() * dtype.itemsize
    return total
