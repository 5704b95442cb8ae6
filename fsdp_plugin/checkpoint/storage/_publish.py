"""Atomic publication of a finished checkpoint directory and cleanup of leftovers.

``publish(tmp, path)``: ``tmp`` (a complete, fsynced sibling of ``path``) replaces ``path`` atomically:
``renameat2(RENAME_EXCHANGE)`` when the filesystem supports it (no instant without a complete
checkpoint at ``path``), else ``rename(path, path.old-<id>)`` + ``rename(tmp, path)`` (a crash in between
leaves ``path.old-<id>``, which the load error points to). The parent directory is fsynced, then the
old checkpoint removed.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import uuid
import warnings

from ..format import manifest
from ..errors import CheckpointError
from .fsio import fsync_path
from . import is_url, join

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_OUR_FILE = re.compile(r"^(rank\d{5,}\.(model|optim|extra)\.safetensors|manifest\.json(\.tmp)?)$")


def tmp_name(path: str, uid: str) -> str:
    """Where a save writes before it is published: a sibling directory, or on an object store the save's own
    prefix under ``path`` (nothing is renamed there: see :mod:`._publish_remote`)."""
    return join(path, uid) if is_url(path) else f"{path}.tmp-{uid}"


def check_replaceable(path: str) -> None:
    """Refuse to overwrite anything but a (possibly incomplete) fsdp_plugin checkpoint or an empty dir."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a checkpoint directory; refusing to replace it")
    foreign = [n for n in os.listdir(path) if not _OUR_FILE.match(n)]
    if foreign:
        raise CheckpointError(f"{path} exists and holds files that are not part of an fsdp_plugin checkpoint "
                              f"({', '.join(sorted(foreign)[:5])}); refusing to replace it")


def clean_stale(path: str) -> None:
    """Remove ``path.tmp-*`` (interrupted saves) and, when ``path`` is complete, ``path.old-*`` siblings."""
    parent, base = os.path.split(path)
    complete = os.path.exists(os.path.join(path, manifest.NAME))
    pat = re.compile(re.escape(base) + r"\.(tmp|old)-[0-9a-f]{32}$")
    for name in os.listdir(parent):
        m = pat.match(name)
        if m and (m.group(1) == "tmp" or complete):
            warnings.warn(f"removing {os.path.join(parent, name)} left by an interrupted checkpoint save")
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def publish(tmp: str, path: str) -> None:
    """Move complete directory ``tmp`` to ``path`` atomically (see module docstring)."""
    parent = os.path.dirname(path)
    fsync_path(tmp, directory=True)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        fsync_path(parent, directory=True)
        return
    if _exchange(tmp, path):
        fsync_path(parent, directory=True)
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous checkpoint
        return
    old = f"{path}.old-{uuid.uuid4().hex}"
    os.rename(path, old)
    os.rename(tmp, path)
    fsync_path(parent, directory=True)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False when unsupported here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0
