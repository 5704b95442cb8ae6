"""The Trainer's model + optimizer + scheduler state in fsdp_plugin's sharded format (no pickle).

Inside a Trainer checkpoint folder (``checkpoint-<step>/``) the directory :data:`CHECKPOINT_DIR` is an
``fp.save_checkpoint`` directory: model shards, optimizer shards and, in ``extra``, the learning-rate
scheduler's state. It loads at any process count. Files the Trainer writes itself (``trainer_state.json``,
RNG states, ``training_args.bin``) are left to it.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import fsdp_plugin as fp
from fsdp_plugin.checkpoint.format import manifest
from fsdp_plugin.checkpoint.storage import join, require_local, storage_for
from fsdp_plugin.integrations import _pending_save as pending_save

from . import _remote_output

CHECKPOINT_DIR = "fsdp_plugin_state"
FORMAT = "fsdp_plugin.transformers/1"
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")


class TrainerCheckpointError(fp.CheckpointError):
    """A Trainer checkpoint folder that fsdp_plugin's Trainer cannot resume from."""


def state_dir(checkpoint: str) -> str:
    """Where the sharded state lives inside a Trainer checkpoint folder (at the URL a staging folder mirrors)."""
    url = _remote_output.url_of(checkpoint)
    return join(url, CHECKPOINT_DIR) if url is not None else os.path.join(checkpoint, CHECKPOINT_DIR)


def has_state(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds a committed sharded state (its manifest exists)."""
    where = state_dir(checkpoint)
    return storage_for(where).size(join(where, "manifest.json")) is not None


def stock_fsdp_dirs(checkpoint: str) -> tuple[str, str] | None:
    """``(model dir, optimizer dir)`` of a stock Trainer FSDP ``SHARDED_STATE_DICT`` checkpoint (torch DCP
    written by accelerate: ``pytorch_model_fsdp_0/``, ``optimizer_0/``), or None."""
    from fsdp_plugin.checkpoint.dcp import is_dcp_dir

    model_dir = os.path.join(checkpoint, "pytorch_model_fsdp_0")
    return (model_dir, os.path.join(checkpoint, "optimizer_0")) if is_dcp_dir(model_dir) else None


def _load_stock_fsdp(trainer: Any, checkpoint: str, with_optimizer: bool) -> None:
    """Model (+ optimizer, + ``scheduler.pt`` read with ``weights_only=True``) from a stock FSDP checkpoint."""
    import torch
    from fsdp_plugin.checkpoint.dcp import is_dcp_dir, load_dcp

    model_dir, optim_dir = stock_fsdp_dirs(checkpoint)
    optimizer = _optimizer(trainer) if with_optimizer and is_dcp_dir(optim_dir) else None
    load_dcp(model_dir, trainer.model, optimizer, optimizer_path=optim_dir if optimizer is not None else None)
    sched, sched_file = getattr(trainer, "lr_scheduler", None), os.path.join(checkpoint, "scheduler.pt")
    if optimizer is not None and sched is not None and os.path.isfile(sched_file):
        sched.load_state_dict(torch.load(sched_file, map_location="cpu", weights_only=True))


def has_hf_weights(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds Hugging Face safetensors weights (``save_only_model`` / full saves)."""
    return any(os.path.isfile(os.path.join(checkpoint, name)) for name in _HF_WEIGHTS)


def _optimizer(trainer: Any) -> Any:
    opt = getattr(trainer, "optimizer", None)
    return getattr(opt, "optimizer", opt)  # strip accelerate's AcceleratedOptimizer


def save(trainer: Any, checkpoint: str, with_optimizer: bool = True) -> None:
    """Collective: model (+ optimizer + scheduler) of ``trainer`` into ``checkpoint/CHECKPOINT_DIR``."""
    checkpoint = require_local(checkpoint, "Trainer checkpoint (TrainingArguments.output_dir)")
    sched = getattr(trainer, "lr_scheduler", None) if with_optimizer else None
    extra = {"format": FORMAT, "lr_scheduler": sched.state_dict() if sched is not None else None}
    optimizer = _optimizer(trainer) if with_optimizer else None
    _pending(trainer).start(lambda: fp.save_checkpoint(state_dir(checkpoint), trainer.model, optimizer, extra=extra))


def _pending(trainer: Any) -> pending_save.PendingSave:
    """The Accelerator's save tracker: a Trainer save or load waits for its ``save_state(async_save=...)``."""
    accelerator = getattr(trainer, "accelerator", None)
    return pending_save.of(accelerator) if accelerator is not None else pending_save.PendingSave()


def _saved_optimizers(checkpoint: str) -> int:
    return len(manifest.read(state_dir(checkpoint)).get("optimizers") or [])


def load(trainer: Any, checkpoint: str, with_optimizer: bool = True) -> None:
    """Collective: inverse of :func:`save` into the (already sharded) ``trainer.model``, any process count.

    Falls back to Hugging Face weights (model only) when the folder has no sharded state.
    """
    _pending(trainer).wait()
    checkpoint = require_local(checkpoint, "Trainer resume_from_checkpoint")
    if has_state(checkpoint):
        optimizer = _optimizer(trainer) if with_optimizer and _saved_optimizers(checkpoint) else None
        extra = fp.load_checkpoint(state_dir(checkpoint), trainer.model, optimizer) or {}
        if extra.get("format") != FORMAT:
            raise TrainerCheckpointError(f"{state_dir(checkpoint)} was not written by fsdp_plugin's Trainer "
                                         "integration; resume from a checkpoint-<step> folder it wrote")
        sched = getattr(trainer, "lr_scheduler", None)
        if optimizer is not None and sched is not None and extra.get("lr_scheduler") is not None:
            sched.load_state_dict(extra["lr_scheduler"])
        if with_optimizer and optimizer is None:
            warnings.warn(f"{checkpoint} holds no optimizer state (save_only_model?): the optimizer and the "
                          "learning-rate schedule restart", stacklevel=3)
        return
    if stock_fsdp_dirs(checkpoint) is not None:  # resuming a stock torch-FSDP Trainer run
        _load_stock_fsdp(trainer, checkpoint, with_optimizer)
        return
    if has_hf_weights(checkpoint):
        fp.load_pretrained(trainer.model, checkpoint)
        if with_optimizer:
            warnings.warn(f"{checkpoint} holds only model weights: the optimizer and the learning-rate schedule "
                          "restart", stacklevel=3)
        return
    raise TrainerCheckpointError(f"{checkpoint} has neither {CHECKPOINT_DIR}/ (fsdp_plugin's sharded state), "
                                 "pytorch_model_fsdp_0/ (a stock FSDP run) nor Hugging Face safetensors weights: "
                                 "give a checkpoint-<step> folder written by a Trainer")
