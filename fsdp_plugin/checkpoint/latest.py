"""``latest_checkpoint(root)``: the checkpoint a restarted job resumes from (torchrun ``--max-restarts``).

A checkpoint is complete once its ``manifest.json`` is published (the commit marker; written last, see
:mod:`fsdp_plugin.checkpoint.storage._publish`), so a directory without one, an interrupted save's ``*.tmp-*``
and a replaced one's ``*.old-*`` are skipped, as is a directory whose manifest is invalid or whose files
are missing or of the wrong size. ``verify=True`` also checks every CRC32 block (reads everything).

"Newest" is the highest ``extra={"step": n}`` (rank 0's) among those that saved one, else the latest
``created_unix``; the name breaks ties. Under a process group rank 0 decides and broadcasts the path, so
every rank loads the same checkpoint even when a shared file system shows them different listings.
"""
from __future__ import annotations

import os
from typing import Optional

from . import _comm
from .format import manifest
from .errors import CheckpointError
from .storage import files_dir, join, resolve, storage_for


def latest_checkpoint(root, verify: bool = False) -> Optional[str]:
    """The newest complete checkpoint directory under ``root`` (a path or an fsspec URL), or None (none yet).

    On an object store each entry of ``root`` is a prefix; it counts once its ``manifest.json`` is published and
    every object it names has the recorded size (see :mod:`.remote`).

    Collective under a process group: call it on every rank (rank 0 scans, the others receive its answer).
    """
    root = resolve(root, "latest_checkpoint")
    found = _newest(root, verify) if _comm.rank() == 0 else None
    if _comm.world_size() > 1:
        with _comm.deadline(None, "latest_checkpoint"):
            data = _comm.broadcast_bytes(found.encode() if found else b"", step="rank 0's choice")
        found = data.decode() or None
    return found


def _newest(root: str, verify: bool) -> Optional[str]:
    st = storage_for(root)
    best, best_key = None, None
    for name in st.listdir(root):
        path = join(root, name)
        if ".tmp-" in name or ".old-" in name or (not st.remote and not os.path.isdir(path)):
            continue  # on an object store a name is a prefix; one without a published manifest is skipped below
        doc = _complete(path, verify)
        if doc is None:
            continue
        key = _order(doc, name)
        if best_key is None or key > best_key:
            best, best_key = path, key
    return best


def _complete(path: str, verify: bool) -> Optional[dict]:
    """The manifest of a complete checkpoint at ``path``, or None."""
    try:
        doc = manifest.read(path)
        st, where = storage_for(path), files_dir(path, doc)
    except CheckpointError:
        return None
    for fname, rec in doc["files"].items():
        try:
            if st.size(join(where, fname)) != rec["bytes"]:
                return None
        except CheckpointError:
            return None
    if verify:
        from .tools import verify_checkpoint
        if verify_checkpoint(path):
            return None
    return doc


def _order(doc: dict, name: str) -> tuple:
    step = (doc.get("extra") or {}).get("0", {})
    step = step.get("step") if isinstance(step, dict) else None
    has_step = isinstance(step, int) and not isinstance(step, bool)
    return (has_step, step if has_step else 0, float(doc.get("created_unix", 0.0)), name)
