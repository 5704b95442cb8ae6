"""URL or local path: the only test every storage decision starts from (no dependencies, imported everywhere)."""
from __future__ import annotations

import os
import re

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def scheme(path) -> str | None:
    """The URL scheme of ``path`` (``"s3"``), or None for a plain path."""
    if not isinstance(path, str):
        path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    m = _SCHEME.match(path)
    return m.group(1).lower() if m else None


def is_url(path) -> bool:
    """Whether ``path`` is an object-store URL (``file://`` is not: it is a local path)."""
    s = scheme(path)
    return s is not None and s != "file"


def join(path: str, *names: str) -> str:
    """``path/name/...`` for local paths and URLs alike (URLs always use ``/``)."""
    return "/".join([path.rstrip("/"), *names]) if is_url(path) else os.path.join(path, *names)
