"""Publication on an object store (no rename): the manifest object, created last, is the commit.

``P/<uuid>/...`` holds one save's objects (written by every rank in parallel); ``P/manifest.json`` names the
uuid it commits. See :mod:`.remote` for the promises and why they hold.
"""
from __future__ import annotations

import json
import time
import warnings

from ..format import manifest
from ..errors import CheckpointError
from .remote import is_save_prefix
from . import join, storage_for


#: A prefix without a published manifest is removed by the next save to the same path only when its newest
#: object is older than this (seconds): a younger one may belong to a save still uploading (another job, or a
#: slow rank), whose objects must not vanish under it.
STALE_S = 3600.0


def published_uid(path: str) -> str | None:
    """The uuid committed by ``path/manifest.json`` (None when there is none or it is unreadable)."""
    raw = storage_for(path).read_small(join(path, manifest.NAME), manifest.MAX_MANIFEST_BYTES)
    if raw is None:
        return None
    try:
        uid = json.loads(raw).get("uuid")
    except (ValueError, AttributeError):
        return None
    return uid if isinstance(uid, str) and is_save_prefix(uid) else None


def prepare(path: str) -> None:
    """Rank 0, before a save: refuse a prefix holding foreign objects; remove interrupted saves' prefixes."""
    st = storage_for(path)
    names = st.listdir(path)
    foreign = [n for n in names if n != manifest.NAME and not is_save_prefix(n)]
    if foreign:
        raise CheckpointError(f"{path} holds objects that are not part of an fsdp_plugin checkpoint "
                              f"({', '.join(foreign[:5])}); refusing to save over them")
    keep = published_uid(path)
    for n in names:
        if is_save_prefix(n) and n != keep and _age_s(st, join(path, n)) > STALE_S:
            warnings.warn(f"removing {join(path, n)} left by an interrupted checkpoint save")
            st.remove_tree(join(path, n))


def _age_s(st, prefix: str) -> float:
    """Seconds since the newest object under ``prefix`` was written (0 when the store cannot say)."""
    newest = None
    for name in st.listdir(prefix):
        try:
            t = st.fs.modified(st._p(join(prefix, name))).timestamp()
        except (NotImplementedError, OSError, AttributeError, ValueError):
            return 0.0
        newest = t if newest is None else max(newest, t)
    return 0.0 if newest is None else time.time() - newest


def publish(tmp: str, path: str, data: bytes) -> None:
    """Commit the save whose objects are under ``tmp`` = ``path/<uuid>`` by writing ``path/manifest.json``.

    A fresh path is created with a conditional write (two writers: one wins, the other raises here); an existing
    checkpoint's manifest is overwritten in one PUT, then its objects are deleted (it stayed loadable until now).
    """
    st = storage_for(path)
    old = published_uid(path)
    for name in _names_in(data):  # our objects are all there (a concurrent save may have removed a prefix)
        if st.size(join(tmp, name)) is None:
            raise CheckpointError(f"{join(tmp, name)} vanished before the save was published (another save to "
                                  f"{path} removed it?); nothing was published")
    try:
        st.create_exclusive(join(path, manifest.NAME), data, exclusive=old is None)
    except FileExistsError:
        raise CheckpointError(f"{path}: another save published a checkpoint there first (its manifest.json was "
                              "created while this save was uploading); this save's objects are removed. Save "
                              "each step to its own path.") from None
    if old is not None and join(path, old) != tmp:
        st.remove_tree(join(path, old))


def _names_in(data: bytes) -> list[str]:
    return sorted(json.loads(data)["files"])
