"""The units `fp.shard` would build, found with the engine's own wrap-policy code (no allocation)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from .._wrap import owner_unit, parameter_sites, select_unit_modules


@dataclass
class HandleSpec:
    """One flat buffer: the parameters of one unit sharing (dtype, requires_grad), in order."""

    unit: int                 # index into the unit list
    dtype: torch.dtype        # master (shard) dtype
    requires_grad: bool
    numel: int                # unpadded elements
    param_ids: list = field(default_factory=list)
    largest: int = 0          # elements of its largest parameter

    def padded(self, shard_size: int) -> int:
        return -(-self.numel // shard_size) * shard_size

    def chunk(self, shard_size: int) -> int:
        return self.padded(shard_size) // shard_size


@dataclass
class UnitSpec:
    fqn: str
    module: nn.Module
    handles: list = field(default_factory=list)   # indices into the handle list

    @property
    def name(self) -> str:
        return self.fqn or "<root>"


def discover_units(model: nn.Module, policy, ignored=()) -> tuple[list[UnitSpec], list[HandleSpec]]:
    """Units root first (as fp.shard orders them) and their handles, grouped exactly like fp.shard."""
    chosen = select_unit_modules(model, policy, ignored)
    sites = parameter_sites(model, ignored)
    by_id: dict[int, nn.Parameter] = {}
    for _, p in model.named_parameters():
        if id(p) in sites:
            by_id.setdefault(id(p), p)
    fqns = [f for f, _ in chosen]
    owned: dict[str, list] = {f: [] for f in fqns}
    for pid, p in by_id.items():
        owned[owner_unit([s[0] for s in sites[pid]], fqns)].append(p)
    units, handles = [], []
    for i, (fqn, module) in enumerate(chosen):
        unit = UnitSpec(fqn, module)
        groups: OrderedDict = OrderedDict()
        for p in owned[fqn]:
            groups.setdefault((p.dtype, p.requires_grad), []).append(p)
        for (dtype, rg), params in groups.items():
            unit.handles.append(len(handles))
            handles.append(HandleSpec(i, dtype, rg, sum(p.numel() for p in params), [id(p) for p in params],
                                      max(p.numel() for p in params)))
        units.append(unit)
    return units, handles


def buffer_bytes(model: nn.Module, buffer_dtype=None) -> int:
    seen, total = set(), 0
    for b in model.buffers():
        if id(b) in seen:
            continue
        seen.add(id(b))
        dtype = buffer_dtype if (buffer_dtype is not None and b.is_floating_point()) else b.dtype
        total += b.numel() * dtype.itemsize
    return total
