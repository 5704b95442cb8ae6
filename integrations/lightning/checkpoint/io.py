"""Lightning checkpoints on the fsdp_plugin engine, pickle-free, in two layouts.

* ``sharded`` (default): ``path`` is the engine's checkpoint directory (``fp.save_checkpoint``: per-rank
  safetensors + ``manifest.json``). Lightning's other state (loops, callbacks, schedulers, hparams,
  precision state, ...) goes through :mod:`fsdp_plugin.checkpoint.format.codec` into the manifest's ``extra``. Loadable at any world size.
* ``full``: ``path`` is one file in Lightning's own torch format (see :mod:`._torch_file`):
  ``{"state_dict": plain weights, **Lightning's state}``, so ``MyModule.load_from_checkpoint(path)`` and
  ``torch.load(path, weights_only=True)`` read it on a machine without a process group. We read it back
  without pickle through a JSON index in the same archive, which also carries Lightning's state through
  the codec (its few tensors inline) and the optimizers' param-group hyper-parameters; their
  per-parameter state (Adam moments) is not stored. Files written by earlier versions (safetensors, the
  state in the header's ``__metadata__``) still load.

Save/load are collective: call them on every rank. Callers run :func:`encode_meta` first, so an
unsupported value raises the same :class:`~fsdp_plugin.CodecError` on every rank before any communication.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fsdp_plugin.checkpoint import _comm
from fsdp_plugin.checkpoint.format import codec
from fsdp_plugin.checkpoint import storage
from fsdp_plugin.checkpoint.errors import CheckpointStateError
from safetensors import safe_open

import fsdp_plugin as fp
from fsdp_plugin.integrations.lightning.checkpoint import codec_v1 as _codec_v1
from fsdp_plugin.integrations.lightning.checkpoint import remote_full
from fsdp_plugin.integrations.lightning.checkpoint import torch_file as torch_file

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


def as_path(p: Any) -> Path | str:
    """A checkpoint path as Lightning gave it: ``Path`` for a local one, the ``str`` for a URL (``Path`` would
    collapse ``s3://b`` into a local ``s3:/b``); a ``file://`` URL becomes a local path."""
    p = str(p)
    return p if storage.is_url(p) else Path(storage.resolve(p, "Lightning checkpoint path"))


def save_sharded(path: Path, model: torch.nn.Module, optimizers: Sequence[Any], encoded: tuple,
                 async_save: bool | str = False) -> Any:
    """Write the engine's sharded directory at ``path`` with Lightning's encoded state in ``extra``.

    Returns the ``fp.AsyncSave`` handle when ``async_save`` (see ``fp.save_checkpoint``), else None.
    """
    tree, tensors = encoded
    return fp.save_checkpoint(str(path), model, _optim_arg(optimizers),
                              extra={EXTRA_KEY: tree, EXTRA_TENSORS_KEY: tensors}, async_save=async_save)


def load_sharded(path: Path, model: torch.nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """Load model (and optimizers, if given) from a sharded directory; return Lightning's decoded state."""
    extra = fp.load_checkpoint(str(path), model, _optim_arg(optimizers)) or {}
    if EXTRA_KEY not in extra:
        raise CheckpointStateError(f"{path} is an fsdp_plugin checkpoint without Lightning state "
                                   "(saved outside Lightning?)")
    return decode_state(extra[EXTRA_KEY], extra.get(EXTRA_TENSORS_KEY) or {})


def save_full(path: Path, model: torch.nn.Module, meta: dict[str, Any], encoded: tuple) -> None:
    """Write one Lightning-format file (see :mod:`._torch_file`), every rank its own weight bytes (no gather).

    ``meta`` is Lightning's state as Lightning gave it (what ``load_from_checkpoint`` reads); ``encoded`` is
    the same state through the codec (what :func:`load_full` reads, without pickle).
    """
    header = inline_tensors(*encoded)
    json.dumps(header, allow_nan=False)  # fail on every rank, before the collective, if it is not strict JSON
    with _comm.deadline_of(model, "Lightning save_checkpoint"):  # the file exists on return, on every rank
        if remote_full.is_url(path):  # built locally by rank 0, uploaded as one object
            remote_full.save(path, lambda local: torch_file.write_sharded(local, model, meta, {FULL_META_KEY: header}))
            return
        path = Path(storage.require_local(path, "FSDPPluginStrategy(state_dict_type='full') save_checkpoint"))
        torch_file.write_sharded(path, model, meta, {FULL_META_KEY: header})


def load_full(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Load a ``full`` file into a (sharded) model on every rank; return Lightning's decoded state.

    Reads the Lightning-format file this version writes and the safetensors file earlier versions wrote.
    """
    if remote_full.is_url(path):
        with remote_full.local_copy(path) as local:
            state, header = read_full(local)
    else:
        state, header = read_full(path)
    with fp.full_params(model):
        model.load_state_dict(state, strict=True)
    return decode_state(*_outline_tensors(header))


def read_full(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A ``full`` file's weights and its codec header (``{"tree", "tensors"}``), without pickle."""
    if torch_file.is_torch_file(path):
        state, extra = torch_file.read(path)
        header = (extra or {}).get(FULL_META_KEY) if isinstance(extra, dict) else None
    else:  # earlier versions: safetensors, the Lightning state as JSON in the header metadata
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(FULL_META_KEY)
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
        header = json.loads(text) if text is not None else None
    if header is None:
        raise CheckpointStateError(f"{path} holds weights but not fsdp_plugin's Lightning state: it was not "
                                   "written by FSDPPluginStrategy(state_dict_type='full')")
    return state, header


def is_sharded_checkpoint(path: Path) -> bool:
    """An fsdp_plugin checkpoint directory (committed: its manifest exists), local or at a URL."""
    if isinstance(path, str) and storage.is_url(path):
        return storage.storage_for(path).size(storage.join(path, "manifest.json")) is not None
    return path.is_dir() and (path / "manifest.json").is_file()


def inline_tensors(tree: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Pack the codec's tensors into JSON (the codec's exact inline form): they are a few scalars."""
    return {"tree": tree, "tensors": {k: codec.inline_tensor(t) for k, t in tensors.items()}}


def decode_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Lightning's state from the codec; checkpoints of the first release (older tags) stay readable."""
    return _codec_v1.decode(tree, tensors) if _codec_v1.is_v1(tree) else codec.decode_state(tree, tensors)


def _outline_tensors(doc: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors = {k: _codec_v1.b64_tensor(node) if "b64" in node else codec.tensor_from_inline(node, f"tensor {k}")
               for k, node in doc.get("tensors", {}).items()}
    return doc["tree"], tensors


def checkpoint_kind(path: Path) -> str | None:
    """"sharded" (a checkpoint directory), "full" (a file), or None when ``path`` is neither."""
    if is_sharded_checkpoint(path):
        return "sharded"
    if remote_full.is_url(path):  # a URL without a published manifest: an object is a 'full' file
        return "full" if remote_full.exists(path) else None
    return "full" if path.is_file() else None
