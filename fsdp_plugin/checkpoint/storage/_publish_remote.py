"""Publication on an object store (no rename): the manifest object, written last, is the commit.

``P/<uuid>/...`` holds one save's objects (written by every rank in parallel); ``P/manifest.json`` names the
uuid it commits. Every publication is conditional on what the save saw when it began (:class:`Base`, read by
:func:`prepare`): a fresh path is created with ``If-None-Match: *``; an existing checkpoint is replaced with
``If-Match: <the ETag read>`` (s3fs), so of two saves racing to one path exactly one publishes and the other
raises :class:`CheckpointError` naming the save that won. On filesystems we send no precondition through (gcsfs,
adlfs, memory://) a save re-reads the manifest just before the PUT instead: a replace that happened while this save
uploaded is refused the same way; two PUTs within the same few milliseconds can still both succeed there (last
writer wins, both complete checkpoints, never a mix). See :mod:`.remote` for the other promises.
"""
from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass

from ..format import manifest
from ..errors import CheckpointError
from .remote import is_save_prefix
from . import join, storage_for


#: A prefix without a published manifest is removed by the next save to the same path only when its newest
#: object is older than this (seconds): a younger one may belong to a save still uploading (another job, or a
#: slow rank), whose objects must not vanish under it.
STALE_S = 3600.0


@dataclass(frozen=True)
class Base:
    """The published checkpoint a save replaces, as rank 0 read it when the save began."""

    uid: str | None     #: its uuid (the prefix of its objects); None: a manifest without a valid one (damaged)
    token: str | None   #: the manifest's ETag (a conditional replace), None where the store reports none


def read_base(path: str) -> Base | None:
    """What ``path/manifest.json`` commits now (None when there is none; ``uid`` None when it is damaged: the save
    replaces it like a valid one)."""
    got = storage_for(path).read_versioned(join(path, manifest.NAME), manifest.MAX_MANIFEST_BYTES)
    return None if got is None else Base(_uid_of(got[0]), got[1])


def published_uid(path: str) -> str | None:
    """The uuid committed by ``path/manifest.json`` (None when there is none or it is unreadable)."""
    raw = storage_for(path).read_small(join(path, manifest.NAME), manifest.MAX_MANIFEST_BYTES)
    return None if raw is None else _uid_of(raw)


def _uid_of(raw: bytes) -> str | None:
    try:
        uid = json.loads(raw).get("uuid")
    except (ValueError, AttributeError):
        return None
    return uid if isinstance(uid, str) and is_save_prefix(uid) else None


def prepare(path: str) -> Base | None:
    """Rank 0, before a save: refuse a prefix holding foreign objects; remove interrupted saves' prefixes;
    return what is published (the publication at the end is conditional on it)."""
    st = storage_for(path)
    names = st.listdir(path)
    foreign = [n for n in names if n != manifest.NAME and not is_save_prefix(n)]
    if foreign:
        raise CheckpointError(f"{path} holds objects that are not part of an fsdp_plugin checkpoint "
                              f"({', '.join(foreign[:5])}); refusing to save over them")
    base = read_base(path)
    for n in names:
        if is_save_prefix(n) and n != (base and base.uid) and _age_s(st, join(path, n)) > STALE_S:
            warnings.warn(f"removing {join(path, n)} left by an interrupted checkpoint save")
            st.remove_tree(join(path, n))
    return base


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


def stamped(doc: dict) -> dict:
    """``doc`` naming its writer (host, pid): what a save that loses a race reports about the winner."""
    return dict(doc, writer={"host": socket.gethostname(), "pid": os.getpid()})


def publish(tmp: str, path: str, data: bytes, base: Base | None) -> None:
    """Commit the save whose objects are under ``tmp`` = ``path/<uuid>`` by writing ``path/manifest.json``,
    conditional on ``base`` (what :func:`prepare` read); then delete the replaced save's objects (it stayed
    loadable until now). Raises :class:`CheckpointError` when another save published first."""
    st = storage_for(path)
    ours, where = tmp.rsplit("/", 1)[-1], join(path, manifest.NAME)
    for name in _names_in(data):  # our objects are all there (a concurrent save may have removed a prefix)
        if st.size(join(tmp, name)) is None:
            raise CheckpointError(f"{join(tmp, name)} vanished before the save was published (another save to "
                                  f"{path} removed it?); nothing was published")
    for _ in range(2):  # a second try only when the condition failed although nobody else published (S3's 409)
        try:
            if base is None:
                st.create_exclusive(where, data, exclusive=True)
            elif st.conditional_replace and base.token is not None:
                st.replace_if(where, data, base.token)
            else:  # no server-side compare-and-swap: compare just before the PUT (see the module docstring)
                if published_uid(path) != base.uid:
                    raise FileExistsError(where)
                st.replace_if(where, data, None)
            break
        except FileExistsError:
            now = published_uid(path)
            if now == ours:  # a retried PUT whose first attempt had succeeded
                break
            if now != (base and base.uid):
                raise CheckpointError(_lost_race(path, base, now)) from None
    else:
        raise CheckpointError(f"{where}: the conditional write was refused twice although the checkpoint did not "
                              "change (the object store reported a conflicting request); save again")
    if base is not None and base.uid is not None and base.uid != ours:
        st.remove_tree(join(path, base.uid))


def _lost_race(path: str, base: Base | None, now: str | None) -> str:
    what = "published a checkpoint there first" if base is None else (
        f"replaced the checkpoint this save was replacing (uuid {base.uid})")
    return (f"{path}: another save {what} while this one was uploading: {_describe(path, now)}. That checkpoint "
            "is kept and loadable; this save's objects are removed and nothing of it was published. Two jobs (or "
            "two trainers) are saving to the same path: give each its own root, or each step its own path.")


def _describe(path: str, uid: str | None) -> str:
    """The winner, as its manifest names it: uuid, writer host and pid, time, step."""
    if uid is None:
        return "its manifest.json is gone again (a third writer deleted it?)"
    try:
        doc = json.loads(storage_for(path).read_small(join(path, manifest.NAME), manifest.MAX_MANIFEST_BYTES))
    except (TypeError, ValueError, CheckpointError):
        return f"uuid {uid}"
    writer = doc.get("writer") if isinstance(doc.get("writer"), dict) else {}
    when = doc.get("created_unix")
    step = ((doc.get("extra") or {}).get("0") or {})
    step = step.get("step") if isinstance(step, dict) else None
    parts = [f"uuid {uid}", f"written by host {writer.get('host', '?')} pid {writer.get('pid', '?')}"]
    if isinstance(when, (int, float)):
        parts.append("at " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when)))
    if isinstance(step, int):
        parts.append(f"step {step}")
    return ", ".join(parts)


def _names_in(data: bytes) -> list[str]:
    return sorted(json.loads(data)["files"])
