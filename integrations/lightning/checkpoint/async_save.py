"""Asynchronous sharded checkpoints for the Trainer strategy.

``Trainer(strategy="fsdp_plugin", plugins=[AsyncCheckpointIO()])`` (Lightning's usual switch) or
``FSDPPluginStrategy(async_save=True | "deferred")`` makes ``state_dict_type="sharded"`` saves use
``fp.save_checkpoint(..., async_save=...)``: training resumes after the host snapshot while a background
thread writes and publishes. Lightning's own AsyncCheckpointIO runs a CheckpointIO in an executor thread;
our save is collective and needs no CheckpointIO, so the plugin is only read as the request. The pending
save (``fsdp_plugin.integrations._pending_save``) is waited for by the next save or load and by the
strategy's teardown (errors surface there).
"""
from __future__ import annotations

from typing import Any


def requested(strategy: Any) -> bool | str:
    """The ``async_save`` mode for ``strategy``: its own setting, else True under an AsyncCheckpointIO plugin."""
    mode = getattr(strategy, "_async_save", False)
    if mode:
        return mode
    try:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO
    except ImportError:  # pragma: no cover - Lightning without the plugin
        return False
    return isinstance(getattr(strategy, "_checkpoint_io", None), AsyncCheckpointIO)
