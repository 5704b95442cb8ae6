"""Plan an export by letting a library's own save code run on stand-ins: ``placeholders(model)`` is the plain
model's ``state_dict`` as meta tensors (full shapes, no data); the library saves them (ties removed, names and
views converted back, split into files by its own rules) and a capture records what it would write; ``plan``
turns that record into a :func:`.ranged.write_planned` plan, naming for every output tensor the model tensor and
element offset it holds. Meta tensors cost nothing, so planning holds no weights on any rank.
"""
from __future__ import annotations

import torch

from ..format import _format
from .. import _model


def placeholders(model) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """``(state_dict, sources)``: meta stand-ins under the plain model's ``state_dict`` keys, in its order (tied
    aliases share one stand-in, as they share storage), and ``id(stand-in) -> the key it stands for``."""
    by_param = {id(sh.param): sh for sh in _model.param_shards(model, boxes=True)}
    made: dict[int, torch.Tensor] = {}
    out, sources = {}, {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        items = [(n, p, by_param[id(p)].shape if id(p) in by_param else p.shape)
                 for n, p in module._parameters.items() if p is not None]
        items += [(n, b, b.shape) for n, b in module._buffers.items()
                  if b is not None and n not in module._non_persistent_buffers_set]
        for name, t, shape in items:
            if id(t) not in made:
                made[id(t)] = torch.empty(tuple(shape), dtype=t.dtype, device="meta")
                sources[id(made[id(t)])] = pre + name
            out[pre + name] = made[id(t)]
    return out, sources


def plain_numel(model) -> dict[int, int]:
    """``id(parameter) -> element count of the plain (unsharded) parameter`` (a sharded parameter holds a piece)."""
    return {id(sh.param): sh.shape.numel() for sh in _model.param_shards(model, boxes=True)}


def plan(files: list[tuple[str, dict | None, dict]], sources: dict[int, str],
         known_runs=None) -> tuple[list | None, str]:
    """``(plan, "")``: ``[path, metadata, [[name, dtype, shape, runs], ...]]`` per captured
    ``(path, metadata, tensors)`` (runs as :mod:`.ranged` reads them); or ``(None, why)`` when a tensor is
    neither a stand-in nor a contiguous view of one, nor named by ``known_runs()`` (called once, when needed:
    ``{output name: runs}`` for tensors the library copies, e.g. :func:`.hf.fused_runs`)."""
    out, known = [], None
    for path, metadata, tensors in files:
        entries = []
        for name, t in tensors.items():
            entry = _entry(name, t, sources)
            if entry is None and known_runs is not None:
                known = known_runs() if known is None else known
                entry = _known(name, t, known)
            if entry is None:
                return None, f"{name!r} is not a model tensor or a contiguous slice of one"
            entries.append(entry)
        out.append([path, metadata, entries])
    return out, ""


def _entry(name: str, t: torch.Tensor, sources: dict[int, str]) -> list | None:
    base, start = t, 0
    if id(t) not in sources and t._base is not None and t.is_contiguous():
        base, start = t._base, t.storage_offset() - t._base.storage_offset()
    if id(base) not in sources or base.dtype != t.dtype:
        return None
    return [name, _format.dtype_name(t.dtype), list(t.shape), [[0, sources[id(base)], start, t.numel()]]]


def _known(name: str, t: torch.Tensor, known: dict) -> list | None:
    runs = known.get(name)
    if runs is None or sum(r[3] for r in runs) != t.numel():
        return None
    return [name, _format.dtype_name(t.dtype), list(t.shape), [list(r) for r in sorted(runs)]]
