"""Build the model to plan for without allocating it: on the meta device (or, if the model's code needs
real values while constructing, under ``fp.deferred_init``).

Accepted sources: a callable returning an ``nn.Module``; an ``nn.Module`` (used as is, meta or real);
``"pkg.module:factory"``; a Hugging Face ``config.json`` or a directory holding one (built with
``AutoModelForCausalLM.from_config``, nothing downloaded).
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Union

import torch
from torch import nn

from .errors import PlanError

ModelSource = Union[nn.Module, Callable[[], nn.Module], str]


def capture(source: ModelSource) -> nn.Module:
    """Return the module described by ``source`` with meta (or deferred) parameters; nothing is allocated."""
    if isinstance(source, nn.Module):
        _refuse_tensor_parallel(source)
        return source
    if isinstance(source, str):
        if os.path.isdir(source) or source.endswith(".json"):
            return _from_hf_config(source)
        if ":" in source:
            return _build(_import_factory(source))
        raise PlanError(f"model {source!r}: give a callable, an nn.Module, 'pkg.module:factory', or a Hugging Face "
                        "config.json / directory holding one")
    if callable(source):
        model = _build(source)
        _refuse_tensor_parallel(model)
        return model
    raise PlanError(f"model {type(source).__name__}: give a callable that builds the model, an nn.Module, "
                    "'pkg.module:factory', or a Hugging Face config path")


def _refuse_tensor_parallel(model: nn.Module) -> None:
    """The planner models data-parallel sharding of plain tensors; DTensor parameters would be mis-sized."""
    name = next((n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"), None)
    if name is not None:
        raise PlanError(f"fp.plan plans a tensor-parallel model from its plain form ({name!r} is already a "
                        "DTensor): pass the model before parallelize_module, with tp_size=<tp degree> and "
                        "tp_plan=<the plan you give parallelize_module> (or 'auto' for transformers' own)")


def _build(factory: Callable[[], nn.Module]) -> nn.Module:
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as meta_error:   # construction read values (e.g. .item()): record it instead
        from .._deferred import deferred_init
        try:
            with deferred_init():
                model = factory()
        except Exception:
            raise meta_error
    if not isinstance(model, nn.Module):
        raise PlanError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model


def _import_factory(spec: str) -> Callable[[], nn.Module]:
    mod_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise PlanError(f"cannot import {mod_name!r} for model {spec!r} ({e}); is it on PYTHONPATH?") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PlanError(f"{mod_name!r} has no attribute {attr!r} (model {spec!r})")
        obj = getattr(obj, part)
    return obj


def _from_hf_config(path: str) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise PlanError("planning from a Hugging Face config needs transformers: pip install transformers") from e
    config = AutoConfig.from_pretrained(path)
    return _build(lambda: AutoModelForCausalLM.from_config(config))


def hf_inputs(model: nn.Module, batch: int, seq_len: int):
    """A micro-batch of token ids for a model without an ``inputs`` callable (HF causal LMs, ids-in models)."""
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    if getattr(model, "config", None) is not None:
        return (), {"input_ids": ids, "labels": ids}
    return (ids,), {}
