"""Lightning checkpoints on the fsdp_plugin engine, pickle-free, in two layouts.

* ``sharded`` (default): ``path`` is the engine's checkpoint directory (``fp.save_checkpoint``: per-rank
  safetensors + ``manifest.json``). Lightning's other state (loops, callbacks, schedulers, hparams,
  precision state, ...) goes through :mod:`fsdp_plugin.checkpoint.codec` into the manifest's ``extra``.
  Loadable at any world size.
* ``full``: ``path`` is one safetensors file holding the plain model ``state_dict`` under its usual keys,
  so ``module.load_state_dict(safetensors.torch.load_file(path))`` works on an unsharded module. The
  Lightning state is JSON in the header's ``__metadata__`` (its few tensors inline, the codec's hex), with the
  optimizers' param-group hyper-parameters; their per-parameter state (Adam moments) is not stored.

Save/load are collective: call them on every rank. Callers run :func:`encode_meta` first, so an
unsupported value raises the same :class:`~fsdp_plugin.CodecError` on every rank before any communication.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fsdp_plugin.checkpoint import codec
from fsdp_plugin.checkpoint.errors import CheckpointStateError
from safetensors import safe_open
from safetensors.torch import save_file

import fsdp_plugin as fp

EXTRA_KEY = "lightning"
EXTRA_TENSORS_KEY = "lightning_tensors"
FULL_META_KEY = "fsdp_plugin.lightning"
MODEL_STATE_KEYS = ("state_dict", "optimizer_states")


PARAM_GROUPS_KEY = "fsdp_plugin_optimizer_param_groups"


def param_group_hypers(optimizers: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """Each optimizer's param-group hyper-parameters (lr, betas, ...), without the parameters."""
    opts = [getattr(o, "_optimizer", o) for o in optimizers]
    return [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in opts]


def apply_param_group_hypers(optimizers: Sequence[Any], saved: Any) -> None:
    """Restore what :func:`param_group_hypers` saved, when the group structure matches."""
    opts = [getattr(o, "_optimizer", o) for o in optimizers]
    if not saved or len(saved) != len(opts):
        return
    for opt, groups in zip(opts, saved, strict=True):
        if len(groups) == len(opt.param_groups):
            for group, hypers in zip(opt.param_groups, groups, strict=True):
                group.update(hypers)


def split_state(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Lightning's checkpoint dict without the model/optimizer state; and whether optimizers were dumped."""
    meta = {k: v for k, v in checkpoint.items() if k not in MODEL_STATE_KEYS}
    return meta, "optimizer_states" in checkpoint


def _optim_arg(optimizers: Sequence[Any]) -> Any:
    """The engine takes one optimizer (or None); several are passed as a list."""
    opts = [getattr(o, "_optimizer", o) for o in optimizers]  # unwrap LightningOptimizer
    if not opts:
        return None
    return opts[0] if len(opts) == 1 else opts


def encode_meta(meta: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode Lightning's state. Call on every rank before any collective: a bad value fails everywhere."""
    return codec.encode_state(meta)


def save_sharded(path: Path, model: torch.nn.Module, optimizers: Sequence[Any], encoded: tuple) -> None:
    """Write the engine's sharded directory at ``path`` with Lightning's encoded state in ``extra``."""
    tree, tensors = encoded
    fp.save_checkpoint(str(path), model, _optim_arg(optimizers), extra={EXTRA_KEY: tree, EXTRA_TENSORS_KEY: tensors})


def load_sharded(path: Path, model: torch.nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """Load model (and optimizers, if given) from a sharded directory; return Lightning's decoded state."""
    extra = fp.load_checkpoint(str(path), model, _optim_arg(optimizers)) or {}
    if EXTRA_KEY not in extra:
        raise CheckpointStateError(f"{path} is an fsdp_plugin checkpoint without Lightning state "
                                   "(saved outside Lightning?)")
    return codec.decode_state(extra[EXTRA_KEY], extra.get(EXTRA_TENSORS_KEY) or {})


def save_full(path: Path, model: torch.nn.Module, encoded: tuple) -> None:
    """Gather the full model state to rank 0 and write one safetensors file (header: Lightning state)."""
    header = json.dumps(_inline_tensors(*encoded), allow_nan=False)
    state = fp.full_state_dict(model)  # collective: rank 0 gets the plain state dict, others {}
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(_unshared(state), str(tmp), metadata={"format": "pt", FULL_META_KEY: header})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    _barrier(model, "waiting for rank 0 to write the full checkpoint file")


def load_full(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load a ``full`` file into a (sharded) model on every rank; return Lightning's decoded state."""
    with safe_open(str(path), framework="pt") as f:
        header = (f.metadata() or {}).get(FULL_META_KEY)
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    if header is None:
        raise CheckpointStateError(f"{path} is a safetensors file without fsdp_plugin's Lightning state; "
                                   "it holds only weights")
    with fp.full_params(model):
        model.load_state_dict(state, strict=True)
    return codec.decode_state(*_outline_tensors(json.loads(header)))


def is_sharded_checkpoint(path: Path) -> bool:
    """An fsdp_plugin checkpoint directory (committed: its manifest exists)."""
    return path.is_dir() and (path / "manifest.json").is_file()


def _inline_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Pack the codec's tensors into JSON (the codec's exact inline form): they are a few scalars."""
    return {"tree": tree, "tensors": {k: codec.inline_tensor(t) for k, t in tensors.items()}}


def _outline_tensors(doc: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors = {k: codec.tensor_from_inline(node, f"tensor {k}") for k, node in doc.get("tensors", {}).items()}
    return doc["tree"], tensors


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): store independent copies."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        out[k] = v.detach().cpu().contiguous() if ptr not in seen else v.detach().cpu().clone()
        seen.add(ptr)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier(model: torch.nn.Module, step: str) -> None:
    """Through fsdp_plugin's collectives: the model's timeout_s, CollectiveError naming the step."""
    from fsdp_plugin.checkpoint import _comm

    with _comm.deadline_of(model, "Lightning save_checkpoint"):
        _comm.barrier(step)


def checkpoint_kind(path: Path) -> str | None:
    """"sharded", "full", or None when ``path`` is neither."""
    if is_sharded_checkpoint(path):
        return "sharded"
    return "full" if path.is_file() else None
