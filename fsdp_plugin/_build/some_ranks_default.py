"""The default of ``ShardingConfig.some_ranks_modules`` (None): a transformers model's modality encoders.

A model whose config has a ``vision_config`` or ``audio_config`` (LLaVA, Qwen2-VL, Gemma 3, Whisper-style audio
LMs...) runs its encoder only on batches holding that modality, so with images on some ranks only its units
would diverge. By default such encoders (the outermost modules at transformers' encoder attribute names,
``wrap._ENCODER_NAMES``: ``vision_tower``, ``visual``, ``audio_tower``...) get the some-ranks schedule on
demand (``_schedule/on_demand.py``: gathered only on steps where some rank's inputs hold the modality);
``some_ranks_modules=()`` opts out. The cost (the encoder's full parameters, held on such steps from the root's
pre-forward to the end of backward by the ranks that ran it) is logged once per process, on rank 0, at WARNING.
"""
from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

_logger = logging.getLogger("fsdp_plugin")
_LOGGED: set = set()
_MODALITY_CONFIGS = ("vision_config", "audio_config")


def has_modality_encoder_config(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule (a LightningModule holding the VLM...) has a transformers config that
    names a vision or audio sub-model."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and any(getattr(config, k, None) is not None for k in _MODALITY_CONFIGS):
            return True
    return False


def default_encoders(model: nn.Module, encoder_names, ignored_ids: set) -> list[str]:
    """Outermost submodules at an encoder attribute name, for a model with a modality config; else []."""
    if not has_modality_encoder_config(model):
        return []
    found: list[str] = []
    for n, m in model.named_modules():
        if n and n.rsplit(".", 1)[-1] in encoder_names and id(m) not in ignored_ids \
                and not any(n.startswith(f + ".") for f in found) and any(True for _ in m.parameters()):
            found.append(n)
    return found


def log_default_cost(model: nn.Module, units) -> None:
    """Once per process (rank 0): which encoders the default chose and the bytes each rank holds all step."""
    some = [u for u in units if u.some_ranks]
    if not some or (dist.is_initialized() and dist.get_rank() != 0):
        return
    key = tuple(u.fqn for u in some)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    held = sum(h.padded * h.compute_dtype.itemsize for u in some for h in u.handles)
    where = ", ".join(f"{u.fqn!r} ({type(u.module).__name__})" for u in some)
    _logger.warning(
        "fsdp_plugin: %s may run on some ranks only (batches without images/audio), so by default it is gathered "
        "whole on steps where some rank's inputs hold pixel_values/input_features (one 1-byte control message per "
        "step decides) and held unsharded until the end of backward by the ranks that ran it: %.1f MB of full "
        "parameters per rank on such steps, nothing on the others (exact gradients; no hang). Pass "
        "some_ranks_modules=() if every batch on every rank holds that modality.",
        where, held / 1e6)
