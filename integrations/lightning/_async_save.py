"""Asynchronous sharded checkpoints for the Trainer strategy.

``Trainer(strategy="fsdp_plugin", plugins=[AsyncCheckpointIO()])`` (Lightning's usual switch) or
``FSDPPluginStrategy(async_save=True | "deferred")`` makes ``state_dict_type="sharded"`` saves use
``fp.save_checkpoint(..., async_save=...)``: training resumes after the host snapshot while a background
thread writes and publishes. Lightning's own AsyncCheckpointIO runs a CheckpointIO in an executor thread;
our save is collective and needs no CheckpointIO, so the plugin is only read as the request. The pending
save is waited for by the next save or load and by the strategy's teardown (errors surface there).
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


def remember(strategy: Any, handle: Any) -> None:
    """Keep the pending save's handle (None for a synchronous save); count the asynchronous saves."""
    strategy._pending_save = handle
    if handle is not None:
        strategy.async_saves = getattr(strategy, "async_saves", 0) + 1


def finish(strategy: Any) -> None:
    """Wait for the pending save, if any; re-raise its failure."""
    handle, strategy._pending_save = getattr(strategy, "_pending_save", None), None
    if handle is not None:
        handle.wait()
