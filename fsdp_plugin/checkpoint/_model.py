"""What the checkpoint code needs from a model: its parameter pieces (via the engine's ``_layout``),
its persistent buffers, and the save-time sharding description.

Invariant: this module is the only place that talks to ``fsdp_plugin._flat.layout``.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import nn

from .errors import CheckpointError


def _layout():
    return importlib.import_module("fsdp_plugin._flat.layout")


def param_shards(model: nn.Module, boxes: bool = False, what: str = "this operation") -> list:
    """``fsdp_plugin._flat.layout.param_shards(model)``: one ParamShard per distinct parameter.

    A tensor-parallel model's pieces are boxes of the global tensor (``ParamShard.box``): only callers that
    read and write boxes (``boxes=True``: save_checkpoint, load_checkpoint) take them; the others refuse."""
    shards = list(_layout().param_shards(model))
    if not boxes:
        tp = next((sh for sh in shards if getattr(sh, "box", None) is not None), None)
        if tp is not None:
            raise CheckpointError(
                f"{what} does not support tensor-parallel models yet ({tp.fqn!r} is a DTensor box): export "
                "full weights with fp.save_pretrained (HF safetensors, every rank writes its boxes), or save with "
                "fp.save_checkpoint (loadable at any dp x tp) and `fsdp-plugin consolidate CKPT OUT`")
    return shards


def piece_runs(sh) -> list[tuple[int, int]]:
    """``(global_start, n)`` runs of the full tensor's flattened elements that ``sh``'s local piece holds, in the
    piece's storage order (``sh.param`` flattened): one run for a plain piece ``[start, end)``, one per row the
    box does not span whole for a tensor-parallel box. Their lengths sum to ``sh.end - sh.start``."""
    from .format.boxes import box_runs

    if sh.box is None:
        return [(sh.start, sh.end - sh.start)] if sh.end > sh.start else []
    return box_runs(tuple(sh.shape), *sh.box) if sh.end > sh.start else []


def sharding_description(model: nn.Module) -> dict:
    """JSON-able ``sharding_info(model)`` (strategy, world_size, rank, shard_size, replicate_size)."""
    info = _layout().sharding_info(model)
    if dataclasses.is_dataclass(info):
        info = dataclasses.asdict(info)
    elif not isinstance(info, dict):
        info = {k: getattr(info, k) for k in ("strategy", "world_size", "rank", "shard_size", "replicate_size")
                if hasattr(info, k)}
    out = {}
    for k, v in info.items():
        out[k] = v if isinstance(v, (int, float, str, bool, type(None))) else str(getattr(v, "value", v))
    out.pop("rank", None)
    out.pop("timeout_s", None)  # a runtime setting, not part of the layout
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for every buffer that ``state_dict`` would contain (shared ones once)."""
    out = []
    for name, buf in model.named_buffers():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if _layout().is_persistent_buffer(mod, leaf):
            out.append((name, buf))
    return out


def flat_dest(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 1-D tensor aliasing ``t``'s memory to load into, and the tensor to copy back from afterwards.

    For a contiguous ``t`` the view itself (second item None); otherwise a contiguous clone that the caller
    copies back into ``t`` after reading.
    """
    t = t.detach()
    if t.is_meta:
        raise CheckpointError("cannot load into a tensor on the meta device: shard the model with "
                              "param_init_fn='skip' (or materialize it) before loading")
    if t.is_contiguous():
        return t.view(-1), None
    tmp = t.contiguous()
    return tmp.view(-1), tmp


def stream_units(model: nn.Module) -> list[list]:
    """The flat-parameter handles of each unit of a sharded model, in unit order (root first); [] if plain.

    Each handle has ``slots`` (``param``, ``shape``), ``padded``/``dtype``, ``gather_master()`` (a new padded
    full flat tensor, collective over its shard group) and ``split_full(full)`` (full-shape views per slot)."""
    root = getattr(model, "_fp_root", None)
    return [] if root is None else [list(unit.handles) for unit in root.units]


def sharding_timeout(model: nn.Module):
    """The model's ``ShardingConfig(timeout_s=...)`` (None: the default deadline)."""
    return getattr(_layout().sharding_info(model), "timeout_s", None)


def full_views(handle, full: torch.Tensor) -> list:
    """``handle.split_full(full)`` with every tensor-parallel slot's local view made its global tensor (an
    all-gather over the TP group: collective, every rank in the same order)."""
    from .._experts.spec import ep_spec, full_tensor as ep_full_tensor
    from .._flat.dtensor import full_tensor

    specs = getattr(handle, "_tp", None) or [None] * len(handle.slots)
    views = [v if t is None else full_tensor(v, t) for v, t in zip(handle.split_full(full), specs)]
    # expert_parallel: local experts become the global [num_experts, ...] tensor (all-gather over EP)
    return [v if ep_spec(s.param) is None else ep_full_tensor(v, ep_spec(s.param))
            for v, s in zip(views, handle.slots)]


def gather_full(handle, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``handle.gather_master()``, cast to ``dtype`` first when given (a floating handle): the same values as
    casting the gathered tensor (an element-wise cast), with the full buffer and the wire in ``dtype``."""
    if dtype is None or dtype == handle.dtype or not handle.dtype.is_floating_point:
        return handle.gather_master()
    from .._comm import collectives as comm

    full = torch.empty(handle.padded, dtype=dtype, device=handle.device)
    src = handle.flat_shard.to(handle.device, dtype)
    if handle.mesh.shard_size == 1:
        full.copy_(src)
    else:
        comm.all_gather(full, src, handle.mesh.shard_group, kind="state_dict")
    return full
