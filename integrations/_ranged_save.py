"""The integrations' exports (transformers ``save_pretrained``, ``Trainer.save_model``, PEFT adapters, accelerate
``save_model``) written
the way the library writes them, without gathering the model: every rank writes its own byte ranges.

How: rank 0 runs the library's own save code on meta stand-ins of the plain model's ``state_dict``
(:func:`fsdp_plugin.checkpoint.hf.export_plan.placeholders`); the library does everything it always does (config,
generation config, tokenizer, adapter config, tied-weight removal, reverse conversion, shard split and index),
except that its safetensors writes are captured instead of performed (:func:`_capture`). The captured files are
then written collectively by :func:`fsdp_plugin.checkpoint.hf.ranged.write_planned`, byte-identical to what the
library would have written from the gathered weights. When the library computes an output tensor from data (a
converted tensor that is not a slice of a model tensor, a cloned alias), the save falls back to gathering the
model to rank 0 and running the library on it (``write_on_rank0``): same files, the old memory cost.
"""
from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from fsdp_plugin.integrations._rank0_save import write_on_rank0

from fsdp_plugin.checkpoint import _comm
from fsdp_plugin.checkpoint.hf import export_plan, ranged
from fsdp_plugin.checkpoint.hf.hf import fused_runs

T = TypeVar("T")
_log = logging.getLogger("fsdp_plugin")

#: ``(module, attribute)`` of every safetensors writer the libraries call, replaced while capturing.
_WRITERS = (("safetensors.torch", "save_file"), ("transformers.modeling_utils", "safe_save_file"),
            ("peft.peft_model", "safe_save_file"), ("accelerate.utils.other", "safe_save_file"))
#: ``(module, attribute)`` of the libraries' alias checks (they compare storages, which meta tensors lack).
_ALIAS_CHECKS = (("peft.peft_model", "id_tensor_storage"), ("accelerate.utils.other", "id_tensor_storage"))


def save_like_library(model: torch.nn.Module, save: Callable[[dict[str, Any]], T], op: str) -> T | None:
    """Collective: ``save(state_dict)`` (the library's own save) on rank 0 with stand-ins, then the captured
    safetensors files written by every rank. Returns ``save``'s result on rank 0, None elsewhere; a failure
    raises on every rank. Deadlines: the model's ``timeout_s``; errors name ``op``."""
    with _comm.deadline_of(model, op):
        result, plan, err = None, None, None
        if _comm.rank() == 0:
            try:
                result, plan = _plan_on_rank0(model, save)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
        _comm.raise_if_any_failed(err, "running the library's save on stand-ins")
        if not _comm.all_true(_comm.rank() != 0 or plan is not None, "agreeing on the export path"):
            with _plain_parameter_count(model):
                return write_on_rank0(model, save, op)
        uid = _comm.broadcast_bytes(uuid.uuid4().hex.encode() if _comm.rank() == 0 else None).decode()
        ranged.write_planned(model, plan, uid)
    return result


def _plan_on_rank0(model, save) -> tuple[Any, list | None]:
    state, sources = export_plan.placeholders(model)
    with _capture(sources) as cap, _plain_parameter_count(model):
        result = save(state)
    plan, why = (export_plan.plan(cap.files, sources, lambda: fused_runs(model)) if not cap.pickled
                 else (None, cap.pickled))
    if plan is None:
        _log.warning("%s: %s; gathering the model to rank 0 to write it", type(model).__name__, why)
    return result, plan


class _Capture:
    """What the library tried to write: safetensors ``files`` ``(abs path, metadata, tensors)``; ``pickled``
    names a ``torch.save`` of stand-ins (e.g. PEFT's ``safe_serialization=False``), which only a gather can write."""

    def __init__(self) -> None:
        self.files: list = []
        self.pickled = ""


@contextlib.contextmanager
def _capture(sources: dict[int, str]) -> Iterator[_Capture]:
    """Inside: the libraries' safetensors writes are recorded instead of performed; a ``torch.save`` holding a
    stand-in is skipped and noted (the caller then gathers); PEFT's and accelerate's alias checks see
    stand-ins as distinct unless they are the same model tensor; huggingface_hub's shard split sees a view
    share its base's storage (meta tensors have none to compare), so it splits as for the real weights."""
    import importlib

    from torch.utils._pytree import tree_leaves

    cap = _Capture()
    real_save = torch.save

    def record(tensors, filename, metadata=None):
        cap.files.append((os.path.abspath(os.fspath(filename)), metadata, dict(tensors)))

    def guarded_save(obj, f, *args, **kwargs):
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(obj)):
            cap.pickled = f"torch.save of the weights to {f}"
            return None
        return real_save(obj, f, *args, **kwargs)

    def storage_id(t):  # meta tensors share no storage; a stand-in's identity is the model tensor it stands for
        base = t._base if t._base is not None else t
        return ("fsdp_plugin stand-in", sources.get(id(base), id(base)))

    import huggingface_hub.serialization._torch as hub

    real_hub_id = hub.get_torch_storage_id

    def hub_storage_id(t):  # the shard split: views share their base's storage (counted once), as real ones do
        if not t.is_meta:
            return real_hub_id(t)
        base = t._base if t._base is not None else t
        return ("fsdp_plugin stand-in", id(base), base.untyped_storage().nbytes())

    patches = ([(m, a, record) for m, a in _WRITERS] + [(m, a, storage_id) for m, a in _ALIAS_CHECKS]
               + [("torch", "save", guarded_save), (hub.__name__, "get_torch_storage_id", hub_storage_id)])
    saved = []
    try:
        for mod_name, attr, fn in patches:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:  # PEFT is optional
                continue
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, fn)
        yield cap
    finally:
        for mod, attr, fn in reversed(saved):
            setattr(mod, attr, fn)


@contextlib.contextmanager
def _plain_parameter_count(model) -> Iterator[None]:
    """Inside: ``model.num_parameters()`` (transformers writes it into the index) counts the plain model's
    elements, as on the unsharded model, not this rank's pieces."""
    if not callable(getattr(type(model), "num_parameters", None)) or "num_parameters" in vars(model):
        yield
        return
    full = export_plan.plain_numel(model)

    def num_parameters(only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        skip = {f"{n}.weight" for n, m in model.named_modules()
                if exclude_embeddings and isinstance(m, torch.nn.Embedding)}
        return sum(full.get(id(p), p.numel()) for n, p in model.named_parameters()
                   if n not in skip and (p.requires_grad or not only_trainable))

    model.num_parameters = num_parameters
    try:
        yield
    finally:
        del model.num_parameters
