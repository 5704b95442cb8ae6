"""Where a checkpoint's bytes live: a local POSIX directory or an fsspec object-store prefix (one seam).

Every checkpoint path argument goes through :func:`resolve` (or :func:`require_local` for entry points that
read local directories only), so a URL is never taken for a local path (``os.path.abspath("s3://b/x")`` is
``<cwd>/s3:/b/x``). ``file://`` URLs become local paths. Any other ``scheme://`` is an object store reached
through fsspec (:mod:`.remote`); an unknown scheme or a missing client package raises
:class:`UnsupportedStorageError` naming the scheme.

:class:`Storage` is the interface the writer, reader, publisher and ``latest`` use; :func:`storage_for` picks
:class:`LocalStorage` or :class:`.remote.ObjectStorage`. A read handle (:class:`ReadHandle`) is an ``int`` file
descriptor locally (so the POSIX fast paths keep ``preadv``) or an object with ``readinto``/``size``/``close``.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Protocol, Union, runtime_checkable

from . import fsio
from ..errors import UnsupportedStorageError
from .urls import is_url, join, scheme

__all__ = ["LOCAL", "LocalStorage", "ReadHandle", "RemoteReadable", "Storage", "files_dir", "is_url", "join",
           "remove_checkpoint", "require_local", "resolve", "scheme", "storage_for"]

#: ``s3:/b/x``: what ``pathlib.Path("s3://b/x")`` makes of a URL (the double slash collapsed).
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/[^/]")


@runtime_checkable
class RemoteReadable(Protocol):
    """A random-access object opened for reading (sizes and offsets in bytes)."""

    size: int

    def readinto(self, bufs: list[memoryview], offset: int) -> None:
        """Fill ``bufs`` in order with the bytes from ``offset`` (one ranged read); raise on a short read."""

    def close(self) -> None: ...


#: An open file: a POSIX fd, or an object-store handle.
ReadHandle = Union[int, RemoteReadable]
#: ``write_stream(write, hint)``: writes the whole file through ``write(view)``; ``hint(offset, n)`` starts
#: writeback of bytes already written (a no-op where there is no page cache).
WriteBody = Callable[[Callable[[memoryview], None], Callable[[int, int], None]], int]


class Storage(Protocol):
    """The operations a checkpoint needs from where it lives. Paths are full paths or URLs."""

    remote: bool

    def open_read(self, path: str, where: str) -> ReadHandle: ...

    def write_file(self, path: str, body: WriteBody) -> int:
        """Create ``path`` exclusively, write it with ``body``, make it durable; return the byte count."""

    def size(self, path: str) -> int | None:
        """Size of file ``path`` in bytes, None when absent."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (files and sub-directories / prefixes); empty when absent."""

    def isdir(self, path: str) -> bool: ...

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it; ignore absence."""


def resolve(path, what: str) -> str:
    """``path`` as the canonical string every rank uses: an absolute local path, or the URL (no trailing ``/``).

    Raises :class:`UnsupportedStorageError` for a URL whose scheme has no installed fsspec filesystem, and for a
    local path that is a URL mangled by ``pathlib`` (``s3:/bucket/x``).
    """
    p = os.fsdecode(os.fspath(path))
    s = scheme(p)
    if s == "file":
        return os.path.abspath(p[len("file://"):])
    if s is None:
        m = _MANGLED.match(p)
        if m and len(m.group(1)) > 1 and not os.path.exists(p):  # "C:/x" is a Windows drive, not a URL
            raise UnsupportedStorageError(
                f"{what}: {p!r} looks like a {m.group(1)}:// URL whose '//' was collapsed (pathlib.Path does that): "
                f"pass the URL as a str, e.g. {m.group(1)}://{p[len(m.group(1)) + 2:]}")
        return os.path.abspath(p)
    from . import remote

    remote.filesystem(p, what)  # raises UnsupportedStorageError naming the scheme when fsspec cannot serve it
    return p.rstrip("/")


def require_local(path, what: str) -> str:
    """``path`` as a local path; a URL raises :class:`UnsupportedStorageError` (entry points without URL support)."""
    p = os.fsdecode(os.fspath(path))
    s = scheme(p)
    if s is not None and s != "file":
        raise UnsupportedStorageError(
            f"{what}: {p!r} is a {s}:// URL, and {what} works on local paths only: give a local path (to move files "
            f"between the two: fsspec.filesystem({s!r}).get(url, local_dir, recursive=True) or .put(local_dir, url, "
            "recursive=True)). fp.save_checkpoint, load_checkpoint, latest_checkpoint, save_pretrained, "
            "load_pretrained, load_dcp and export_dcp take URLs.")
    return resolve(p, what)


def storage_for(path: str) -> Storage:
    """The :class:`Storage` serving resolved ``path`` (see :func:`resolve`)."""
    if is_url(path):
        from . import remote

        return remote.ObjectStorage(path)
    return LOCAL


def files_dir(path: str, doc: dict) -> str:
    """Where the rank files of the checkpoint at ``path`` (manifest ``doc``) are: ``path`` itself on local disk,
    the save's own prefix ``path/<uuid>`` on an object store (see :mod:`.remote`)."""
    if not is_url(path):
        return path
    from .remote import check_uid

    return join(path, check_uid(doc.get("uuid"), join(path, "manifest.json")))


def remove_checkpoint(path: str) -> None:
    """Remove the checkpoint at resolved ``path`` (keep-last-k rotation), its ``manifest.json`` (the commit) first:
    a removal cut short leaves objects that no load and no ``latest_checkpoint`` counts, never a manifest naming
    objects that are gone. Absence is ignored."""
    st = storage_for(path)
    manifest = join(path, "manifest.json")
    if st.remote:
        st.remove_tree(manifest)
    else:
        try:
            os.unlink(manifest)
        except FileNotFoundError:
            pass
    st.remove_tree(path)


class LocalStorage:
    """POSIX directories: exclusive creates, fsync, ``preadv`` (see :mod:`.fsio`, :mod:`.writer`)."""

    remote = False

    def open_read(self, path: str, where: str) -> ReadHandle:
        return fsio.open_in_dir(os.path.dirname(path), os.path.basename(path), where)

    def write_file(self, path: str, body: WriteBody) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            size = body(lambda view: fsio.write_all(fd, view), lambda off, n: fsio.start_writeback(fd, off, n))
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except OSError:
            return None

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


LOCAL = LocalStorage()
