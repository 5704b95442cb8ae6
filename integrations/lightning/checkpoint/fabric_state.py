"""Fabric ``save``/``load`` state dicts on top of the engine checkpoint (see ``_checkpoint``).

A Fabric state dict mixes one module, its optimizer(s) and other objects. The module and optimizers go
through ``fp.save_checkpoint``; everything else (plain values, or ``obj.state_dict()`` for objects that
have one) goes through the pickle-free codec into the checkpoint's ``extra``.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
from torch.nn import Module
from torch.optim import Optimizer
from fsdp_plugin.checkpoint.errors import CheckpointKeyError, CheckpointNotFoundError, CheckpointStateError


def _split(state: dict[str, Any]) -> tuple[str, Module, list[str], dict[str, Any]]:
    """(module key, module, optimizer keys in order, other entries)."""
    modules = [k for k, v in state.items() if isinstance(v, Module)]
    if len(modules) != 1:
        raise CheckpointStateError(f"fsdp_plugin's Fabric checkpoints hold exactly one module; the state has {modules or 'none'}."
                         " "
                         "Save several modules in separate checkpoints.")
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    rest = {k: v for k, v in state.items() if k not in modules and k not in optimizers}
    return modules[0], state[modules[0]], optimizers, rest


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def save(resolve_path: Callable[[], Path], state: dict[str, Any]) -> None:
    """Collective: write ``state`` as an engine checkpoint directory at ``resolve_path()``.

    The state is encoded before ``resolve_path`` (a broadcast) runs, so bad values fail on every rank."""
    module_key, module, opt_keys, rest = _split(state)
    meta = {"module": module_key, "optimizers": opt_keys,
            "state": {k: (v.state_dict() if _stateful(v) else v) for k, v in rest.items()}}
    encoded = ckpt.encode_meta(meta)
    ckpt.save_sharded(resolve_path(), module, [state[k] for k in opt_keys], encoded)


def load(path: Path, state: Any | None, strict: bool) -> dict[str, Any]:
    """Collective: restore ``state``'s objects in place from ``path``; return saved entries not in ``state``."""
    if isinstance(state, Module):
        state = {"model": state}
    if not state:
        raise CheckpointStateError("fsdp_plugin's Fabric checkpoints load in place: pass the state dict with the (set up) "
                         "module, "
                         "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer}).")
    if not ckpt.is_sharded_checkpoint(path):
        raise CheckpointNotFoundError(f"{path} is not an fsdp_plugin checkpoint directory (no manifest.json)")
    _, module, opt_keys, rest = _split(state)
    meta = ckpt.load_sharded(path, module, [state[k] for k in opt_keys])
    saved = meta.get("state", {})
    _check_keys(saved, meta.get("optimizers", []), opt_keys, rest, strict)
    for key, obj in rest.items():
        if key not in saved:
            continue
        if _stateful(obj):
            obj.load_state_dict(saved[key])
        else:
            state[key] = saved[key]
    return {k: v for k, v in saved.items() if k not in rest}


def _check_keys(saved: dict, saved_opts: list, opt_keys: list, rest: dict, strict: bool) -> None:
    missing = [k for k in rest if k not in saved]
    if strict and missing:
        raise CheckpointKeyError(f"checkpoint has no entry for {missing}; saved entries: {sorted(saved)} "
                       "(or load with strict=False)")
    if strict and len(opt_keys) != len(saved_opts):
        raise CheckpointKeyError(f"checkpoint holds optimizers {saved_opts}, the state to load has {opt_keys}")
