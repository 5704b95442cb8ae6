"""Where ``save_state`` writes and ``load_state`` reads: an explicit directory, or accelerate's automatic
``project_dir/checkpoints/checkpoint_<n>`` naming with ``total_limit`` rotation."""
from __future__ import annotations

import os
import shutil
from fsdp_plugin.checkpoint.storage import is_url, require_local, resolve, storage_for
from fsdp_plugin.errors import ConfigError


def _iteration(folder: str) -> int | None:
    """``checkpoint_12`` → 12."""
    head, _, tail = folder.rpartition("_")
    return int(tail) if head and tail.isdigit() else None


def _numbered(root: str) -> list[str]:
    """``checkpoint_<n>`` folders of ``root``, oldest first."""
    return sorted((f for f in os.listdir(root) if _iteration(f) is not None), key=_iteration)


def output_dir(acc, path: str | None) -> str:
    """``path``, or the next automatic checkpoint folder (deleting the oldest beyond ``total_limit``)."""
    cfg = acc.project_configuration
    if not cfg.automatic_checkpoint_naming:
        if path is None:
            raise ConfigError("save_state: give output_dir or enable automatic checkpoint naming")
        path = os.fspath(path)
        return resolve(path, "Accelerator.save_state") if is_url(path) else require_local(path, "save_state")
    root = os.path.join(require_local(acc.project_dir, "Accelerator.save_state (project_dir)"), "checkpoints")
    os.makedirs(root, exist_ok=True)
    folders = _numbered(root)
    if cfg.total_limit is not None and len(folders) + 1 > cfg.total_limit and acc.is_main_process:
        for folder in folders[: len(folders) + 1 - cfg.total_limit]:
            shutil.rmtree(os.path.join(root, folder))
    target = os.path.join(root, f"checkpoint_{acc.save_iteration}")
    if os.path.exists(target):
        raise ConfigError(f"Checkpoint directory {target} already exists; set `save_iteration` to continue")
    return target


def input_dir(acc, path: str | None) -> str:
    """``path``, or the newest automatic checkpoint folder."""
    if path is not None:
        path = os.fspath(path)
        if is_url(path):  # an object store: the state's objects under that prefix
            path = resolve(path, "Accelerator.load_state")
            if not storage_for(path).isdir(path):
                raise ConfigError(f"load_state: nothing is stored under {path}")
            return path
        path = require_local(os.path.expanduser(path), "Accelerator.load_state")
        if not os.path.isdir(path):
            raise ConfigError(f"load_state: {path} does not exist")
        return path
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ConfigError("No input_dir provided and automatic checkpoint naming is disabled.")
    root = os.path.join(acc.project_dir, "checkpoints")
    folders = _numbered(root) if os.path.isdir(root) else []
    if not folders:
        raise ConfigError(f"load_state: no checkpoint_<n> folder in {root}")
    return os.path.join(root, folders[-1])
