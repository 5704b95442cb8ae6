"""Checkpoint names that differ from the module tree: transformers' own conversion mapping.

transformers 5 renames and converts some checkpoints while loading (Mixtral: ``block_sparse_moe.`` ->
``mlp.``, per-expert ``experts.N.w1/w3`` fused into ``experts.gate_up_proj``, ...) and reverts that when
saving (``save_pretrained(save_original_format=True)``, the default). We reuse its objects
(``get_model_conversion_mapping``, ``WeightRenaming``/``WeightConverter``, ``rename_source_key``, the
converters' ``convert``) and do only the bookkeeping here:

* a *rename* maps one stored tensor to one model tensor, byte for byte: ranged reads/writes stay possible;
* a *group* (one converter instance) turns several stored tensors into model tensors (or back): its
  inputs are needed whole, so loading reads every source tensor of the group in full, and saving gathers
  the group's full parameters on one rank before converting and writing them.

Output names and shapes of a group are found by running the converter on meta tensors, so mismatches are
reported before any byte is read. Nothing here imports transformers unless the model is a
``PreTrainedModel`` (its module is then already loaded).
"""
from __future__ import annotations

import copy
import importlib
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..format._format import numel


@dataclass
class Group:
    """One converter application: stored ``sources`` (pattern, name) in order -> ``outputs`` (name -> shape)."""

    converter: object
    target: str
    sources: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    renamings: list | None = None        # saving: applied to the converter's outputs (as transformers does)


def _core():
    return importlib.import_module("transformers.core_model_loading")


def _is_pretrained(model) -> bool:
    mu = sys.modules.get("transformers.modeling_utils")
    return mu is not None and isinstance(model, mu.PreTrainedModel)


def _split(transforms) -> tuple[list, list]:
    core = _core()
    return ([t for t in transforms if isinstance(t, core.WeightRenaming)],
            [t for t in transforms if isinstance(t, core.WeightConverter)])


def load_transforms(model) -> tuple[list, list] | None:
    """(renamings, converters) that ``from_pretrained`` applies to ``model``'s checkpoints, or None."""
    if not _is_pretrained(model):
        return None
    cm = importlib.import_module("transformers.conversion_mapping")
    transforms = cm.get_model_conversion_mapping(model)
    return _split(transforms) if transforms else None


def save_transforms(model) -> tuple[list, list] | None:
    """(renamings, converters) that ``save_pretrained`` applies (reversed load mapping), as in
    ``core_model_loading.revert_weight_conversion``; None when names are written as they are."""
    if not _is_pretrained(model):
        return None
    transforms = getattr(model, "_weight_conversions", None)
    if transforms is None:
        cm = importlib.import_module("transformers.conversion_mapping")
        transforms = [t for t in cm.get_model_conversion_mapping(model, add_legacy=False)
                      if not isinstance(t, _core().PrefixChange)]
    if not transforms:
        return None
    return _split([t.reverse_transform() for t in transforms[::-1]])


def _natural(names):
    return sorted(names, key=_core().dot_natural_key)


def plan_load(model, stored: dict, known: set, transforms=False) -> tuple[dict, list]:
    """Map stored names (-> ``(shape, torch dtype)``) to model names the way ``from_pretrained`` does.

    Returns ``(renames, groups)``: ``renames[model_name] = stored_name`` for one-to-one tensors, and the
    converter groups (``outputs`` = model names and shapes). Stored names matching nothing keep their name.
    ``transforms``: :func:`load_transforms`'s result when the caller already has it.
    """
    if transforms is False:
        transforms = load_transforms(model)
    if transforms is None:
        return {n: n for n in stored}, []
    renamings, converters = transforms
    core, by_pattern = _core(), {p: c for c in converters for p in c.source_patterns}
    lookup = dict.fromkeys(known, True)
    renames, groups = {}, {}
    for name in _natural(stored):
        new, pattern = core.rename_source_key(name, renamings, converters, model.base_model_prefix, lookup)
        if new not in known and name in known:
            new, pattern = name, None
        if pattern is None:
            renames.setdefault(new, name)
        else:
            g = groups.setdefault(new, Group(copy.deepcopy(by_pattern[pattern]), new))
            g.sources.append((pattern, name))
    for g in groups.values():
        _fill_outputs(model, g, stored)
    return renames, list(groups.values())


def plan_save(model, names: list) -> tuple[dict, list]:
    """Map model names to the names ``save_pretrained`` writes: ``(renames, groups)`` with
    ``renames[model_name] = written_name`` and groups whose ``outputs`` are written names and shapes."""
    transforms = save_transforms(model)
    if transforms is None:
        return {n: n for n in names}, []
    renamings, converters = transforms
    core, by_pattern = _core(), {p: c for c in converters for p in c.source_patterns}
    renames, groups = {}, {}
    for name in _natural(names):
        new, pattern = core.apply_converters(name, converters)
        if pattern is None:
            renames[name] = core.apply_renamings(name, renamings)
        else:
            g = groups.setdefault(new, Group(copy.deepcopy(by_pattern[pattern]), new))
            g.sources.append((pattern, name))
    for g in groups.values():
        g.renamings = renamings
    return renames, list(groups.values())


def run(model, group: Group, tensors: dict) -> dict:
    """Apply ``group``'s converter to ``tensors`` (source name -> tensor); return output name -> tensor."""
    conv = copy.deepcopy(group.converter)
    for pattern, name in group.sources:
        conv.add_tensor(group.target, name, pattern, tensors[name])
    out = conv.convert(group.target, model=model, config=getattr(model, "config", None))
    renamings, core = group.renamings, _core()
    result = {}
    for k, v in out.items():
        v = v[0] if isinstance(v, list) else v
        result[core.apply_renamings(k, renamings) if renamings else k] = v
    return result


def save_group_shapes(model, group: Group, shapes: dict, dtypes: dict) -> None:
    """Fill ``group.outputs`` (written name -> shape) by converting meta tensors of the model's shapes."""
    _fill_outputs(model, group, {n: (shapes[n], dtypes[n]) for _, n in group.sources})


def _fill_outputs(model, group: Group, specs: dict) -> None:
    """``group.outputs`` (output name -> shape) from converting meta tensors; ``specs``: source -> (shape, dtype)."""
    metas = {n: torch.empty(specs[n][0], dtype=specs[n][1], device="meta") for _, n in group.sources}
    group.outputs = {k: tuple(v.shape) for k, v in run(model, group, metas).items()}


def drop_ignored(model, missing: list, unexpected: list) -> tuple[list, list]:
    """Remove the names transformers itself tolerates when loading (``_keys_to_ignore_on_load_*``, the
    ``rotary_emb.inv_freq`` / ``position_ids`` buffers older checkpoints still hold)."""
    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if not _is_pretrained(model) or adjust is None:
        return missing, unexpected
    info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
    adjust(info)
    return [n for n in missing if n in info.missing_keys], [n for n in unexpected if n in info.unexpected_keys]


def fused_layout(group: Group, shapes: dict) -> list | None:
    """Where each source lies in the single output, when that is a plain byte layout: ``[(name, offset, numel)]``
    (element offsets into the flattened output), else None.

    The fused-experts converters (``MergeModulelist(dim=0)``, optionally followed by ``Concatenate(dim=1)``,
    used by Mixtral, Qwen2-MoE and the many models mapped to them) stack per-expert tensors and concatenate
    the stacks along the next dimension: output row ``e`` is ``cat(source_k[e] for k in source_patterns)``, so
    every source is one contiguous range of the output and ranged reads/writes stay possible.
    """
    core, ops = _core(), getattr(group.converter, "operations", None) or []
    if len(group.outputs) != 1 or not isinstance(ops[0], core.MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) > 2 or (len(ops) == 2 and not (isinstance(ops[1], core.Concatenate) and ops[1].dim == 1)):
        return None
    by_pattern: dict = {}
    for pattern, name in group.sources:
        by_pattern.setdefault(pattern, []).append(name)
    patterns = [p for p in group.converter.source_patterns if p in by_pattern]
    counts = {len(v) for v in by_pattern.values()}
    if len(counts) != 1 or (len(patterns) > 1 and len(ops) == 1):
        return None
    layout, offset = [], 0
    for e in range(counts.pop()):
        for p in patterns:
            size = numel(shapes[by_pattern[p][e]])
            layout.append((by_pattern[p][e], offset, size))
            offset += size
    return layout if offset == numel(next(iter(group.outputs.values()))) else None


def overlaps(layout: list, start: int, end: int):
    """For a piece ``[start, end)`` of the output: ``(name, source_elem_start, piece_lo, piece_hi)`` per overlap."""
    for name, off, size in layout:
        lo, hi = max(start, off), min(end, off + size)
        if lo < hi:
            yield name, lo - off, lo - start, hi - start
