"""Sharded safetensors checkpoints for fsdp_plugin.

* :func:`save_checkpoint` / :func:`load_checkpoint`: a directory of per-rank safetensors files plus a JSON
  ``manifest.json`` written last; any world size and strategy loads any checkpoint, reading only the byte
  ranges it needs; no pickle anywhere.
* :func:`save_pretrained` / :func:`load_pretrained`: Hugging Face safetensors (+ index) in and out.
* :func:`latest_checkpoint`: the newest complete checkpoint of a directory (resume after a restart).
* :func:`iter_full_params` / :func:`full_params_meta`: full weights streamed unit by unit (RL weight sync).
* :func:`consolidate`: offline export of a checkpoint to Hugging Face safetensors (CLI ``fsdp-plugin``).
"""
from .asyncsave._async import AsyncSave, release_staging_buffers
from .consolidate import consolidate
from .errors import (
    CheckpointError,
    CheckpointKeyError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStateError,
    StateMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchReport,
    UnsafeCheckpointError,
)
from .hf.hf import load_pretrained, save_pretrained
from .latest import latest_checkpoint
from .errors import CheckpointMismatchWarning
from .load import load_checkpoint
from .save import save_checkpoint
from .stream import full_params_meta, iter_full_params
from .tools import inspect_checkpoint, verify_checkpoint

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointKeyError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStateError",
    "StateMismatchError",
    "CheckpointMismatchWarning",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "MismatchReport",
    "UnsafeCheckpointError",
    "consolidate",
    "full_params_meta",
    "iter_full_params",
    "latest_checkpoint",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_pretrained",
    "release_staging_buffers",
    "save_checkpoint",
    "save_pretrained",
    "verify_checkpoint",
]

