"""Replacements for the ``transformers.Trainer`` methods that depend on how the model is distributed.

Each takes the stock method first and defers to it unless fsdp_plugin's engine runs this Trainer
(``trainer.accelerator`` is fsdp_plugin's Accelerator with FSDP selected). With the engine active the
Trainer keeps ``is_fsdp_enabled = False`` so that none of its torch-FSDP code runs; these replacements
provide the sharding-aware behaviour instead:

* the model is not moved to the device as a whole (the engine places each unit's shard);
* checkpoints hold model + optimizer + scheduler in fsdp_plugin's sharded format (``_checkpoint``); with
  ``fsdp_state_dict_type: FULL_STATE_DICT`` (transformers' default) they also hold the full model as
  Hugging Face safetensors, as stock FSDP does;
* ``save_model()`` called by the user always writes Hugging Face safetensors + config (adapter-only for
  PEFT models), every rank writing its own weight bytes;
* resuming loads after ``accelerator.prepare`` (the model must be sharded first), at any process count.
"""
from __future__ import annotations

import os
from typing import Any

from fsdp_plugin.checkpoint.storage import is_url, require_local
from fsdp_plugin.integrations._ranged_save import save_like_library

from . import _checkpoint as ckpt
from . import _remote_output, _trl


def active(trainer: Any) -> bool:
    """Whether fsdp_plugin's engine runs ``trainer``."""
    return bool(getattr(getattr(trainer, "accelerator", None), "_fp_active", False))


def _full_state_dict_type(trainer: Any) -> bool:
    settings = trainer.accelerator.fsdp_settings
    return settings is not None and settings.state_dict_type == "full"


def create_accelerator_and_postprocess(stock, self) -> None:
    """Stock setup with fsdp_plugin's Accelerator (``transformers.trainer.Accelerator`` is patched)."""
    stock(self)
    if not active(self):
        return
    # the Trainer writes output_dir with os.makedirs/open: a URL gets a local staging directory mirroring it
    if is_url(self.args.output_dir):
        _remote_output.attach(self)
    else:
        require_local(self.args.output_dir, "Trainer with fsdp_plugin: TrainingArguments.output_dir")
    self.is_fsdp_enabled = False  # keep the Trainer's torch-FSDP paths off: the methods below replace them
    _trl.prepare(self)            # TRL's vLLM weight sync streams through fp.iter_full_params
    settings = self.accelerator.fsdp_settings
    if settings is not None and settings.activation_checkpointing and self.args.activation_checkpointing:
        from fsdp_plugin.integrations.accelerate.config.settings import config_error

        raise config_error(settings.key("activation_checkpointing"), True,
                           "it and TrainingArguments(gradient_checkpointing=True) would both recompute the blocks; "
                           "keep one of the two")


def move_model_to_device(stock, self, model, device) -> None:
    """No whole-model move: ``prepare`` materializes each unit's shard on the device (the memory saving)."""
    if not active(self):
        return stock(self, model, device)
    return None


def save_model(stock, self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    """Collective. Hugging Face safetensors + config from the main process (adapter only for PEFT).

    Inside checkpoints (``_internal_call``) the weights are written this way only for ``FULL_STATE_DICT``;
    the sharded state holds them (written here, model only, for ``save_only_model``).
    """
    if not active(self):
        return stock(self, output_dir, _internal_call)
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    output_dir = _remote_output.staged(output_dir)  # a URL: written locally, uploaded below
    if _internal_call and self.args.save_only_model:  # no optimizer save follows: the weights go here
        ckpt.save(self, output_dir, with_optimizer=False)
    if _internal_call and not _full_state_dict_type(self):
        os.makedirs(output_dir, exist_ok=True)  # the Trainer looks for the folder (best checkpoint) right after
        return None
    # rank 0 runs the Trainer's writer (config, tokenizer, training arguments); every rank writes its weight bytes
    save_like_library(self.model, lambda state_dict: self._save(output_dir, state_dict=state_dict), "Trainer.save_model")
    if not _internal_call:  # a checkpoint's folder is uploaded whole after the Trainer finished it
        _remote_output.upload(output_dir)
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
    return None


def save_optimizer_and_scheduler(stock, self, output_dir: str) -> None:
    """Collective: model, optimizer and scheduler into ``output_dir/fsdp_plugin_state`` (no pickle)."""
    if not active(self):
        return stock(self, output_dir)
    ckpt.save(self, output_dir, with_optimizer=True)
    return None


def train(stock, self, resume_from_checkpoint=None, *args, **kwargs):
    """Stock ``train``; a URL ``resume_from_checkpoint`` (or True with a URL ``output_dir``) is resumed through a
    local staging copy of the folder (see ``_remote_output``)."""
    if active(self):
        resume_from_checkpoint = _remote_output.resume_path(self, resume_from_checkpoint)
    return stock(self, resume_from_checkpoint, *args, **kwargs)


def save_checkpoint(stock, self, model, *args, **kwargs):
    """Stock ``_save_checkpoint``; with a URL ``output_dir``, then the upload of what the Trainer staged."""
    out = stock(self, model, *args, **kwargs)
    if active(self) and getattr(self, "_fp_output_url", None):
        trial = args[0] if args else kwargs.get("trial")
        _remote_output.after_checkpoint(self, self._get_output_dir(trial=trial))
    return out


def load_from_checkpoint(stock, self, resume_from_checkpoint: str, model=None) -> None:
    """Before ``prepare``: only check the folder; the sharded load happens after ``prepare``."""
    if not active(self):
        return stock(self, resume_from_checkpoint, model)
    if not (ckpt.has_state(resume_from_checkpoint) or ckpt.has_hf_weights(resume_from_checkpoint)
            or ckpt.stock_fsdp_dirs(resume_from_checkpoint) is not None):
        raise ckpt.TrainerCheckpointError(
            f"{resume_from_checkpoint} has neither {ckpt.CHECKPOINT_DIR}/, pytorch_model_fsdp_0/ (a stock FSDP run) "
            "nor Hugging Face safetensors weights: give a checkpoint-<step> folder written by a Trainer")
    return None


def load_optimizer_and_scheduler(stock, self, checkpoint: str | None) -> None:
    """After ``prepare`` on resume: model, optimizer and scheduler from the sharded state."""
    if not active(self) or checkpoint is None:
        return stock(self, checkpoint)
    ckpt.load(self, checkpoint, with_optimizer=True)
    return None


def load_best_model(stock, self) -> None:
    """``load_best_model_at_end``: the best checkpoint's weights into the sharded model."""
    if not active(self):
        return stock(self)
    ckpt.load(self, self.state.best_model_checkpoint, with_optimizer=False)
    return None
