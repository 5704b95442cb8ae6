"""Object-store checkpoints through fsspec (``s3://`` via s3fs, ``gs://``, ``az://``, ``memory://``, ...).

Layout of a checkpoint at URL ``P`` (an object store has no rename, so nothing is moved)::

    P/manifest.json                 the commit marker, written last, with a conditional create
    P/<uuid>/rank00000.model.safetensors ...   the objects of the save whose manifest says "uuid": <uuid>

Promises (the same as on local disk, reached differently):

* every rank uploads its own objects under the save's unique prefix, in parallel (no rank-0 funnel);
* the manifest is created with ``If-None-Match: *`` (fsspec mode ``"xb"``; s3fs sends the header, memory:// and
  local fsspec refuse an existing file), or replaces the one the save read with ``If-Match: <its ETag>``
  (:meth:`ObjectStorage.replace_if`): of two writers racing for the same path exactly one publishes, the other
  fails and removes its objects (see :mod:`._publish_remote`, also for clients without ``If-Match``); the
  previous checkpoint's objects are deleted only after that, so it stays loadable until then;
* a reader reads the manifest first and only the objects it names, so it never sees a half checkpoint;
  checksums (8 MiB CRC32 blocks) are verified on read as locally; loads are ranged GETs of the needed blocks;
* every request is retried (:data:`RETRIES` times, exponential backoff from :data:`BACKOFF_S`) on throttling,
  5xx and connection errors; when retries are exhausted :class:`StorageError` names the URL and operation.
  An upload is retried whole (re-streamed from the tensors' memory).

Credentials and endpoints come from the filesystem's usual configuration (for s3fs: ``AWS_*`` variables,
``~/.aws``, ``AWS_ENDPOINT_URL``, or ``fsspec.config.conf["s3"]``), never from our arguments.
"""
from __future__ import annotations

import errno
import re
import threading
import time
from typing import Any, Callable, TypeVar

from ..errors import CorruptCheckpointError, StorageError, UnsupportedStorageError

#: Attempts after the first one for a request that failed with a transient error.
RETRIES = 4
#: First backoff (seconds); doubled after every failed attempt.
BACKOFF_S = 0.25
#: Multipart upload part size (bytes): a multiple of the 8 MiB CRC32 block, above S3's 5 MiB minimum part.
PART_BYTES = 16 << 20
#: Bytes fetched by ranged reads in this process (all files); tests and benchmarks compare it with the need.
bytes_read = 0
_count_lock = threading.Lock()
_UID = re.compile(r"^[0-9a-f]{32}$")
_TRANSIENT_WORDS = ("slowdown", "throttl", "serviceunavailable", "internalerror", "requesttimeout",
                    "503", "500", "502", "504", "connect", "timeout", "timed out", "endpoint", "reset by peer",
                    "server disconnected", "broken pipe", "internal server error", "service unavailable",
                    "slow down", "bad gateway", "gateway timeout")
T = TypeVar("T")


def filesystem(url: str, what: str = "checkpoint"):
    """``(fs, path_inside_fs)`` for ``url``; :class:`UnsupportedStorageError` naming the scheme if unavailable."""
    scheme = url.split("://", 1)[0].lower()
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise UnsupportedStorageError(f"{what}: {url!r} is a {scheme}:// URL; URLs need fsspec "
                                      f"(pip install fsspec, plus the client of {scheme}://, e.g. s3fs)") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise UnsupportedStorageError(f"{what}: {url!r}: fsspec knows no filesystem for the scheme {scheme!r} "
                                      "(check the URL, or install the package that registers it)") from None
    except ImportError as e:
        raise UnsupportedStorageError(f"{what}: {url!r}: the {scheme}:// filesystem is not installed ({e}); "
                                      f"install it (s3:// needs s3fs, gs:// gcsfs, az:// adlfs)") from None
    return url_to_fs(url)


def transient(e: BaseException) -> bool:
    """Whether ``e`` is worth retrying: throttling, a 5xx, a connection or timeout error (not 4xx, not absence)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                      CorruptCheckpointError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    if isinstance(e, OSError) and e.errno == errno.EREMOTEIO:  # s3fs: a server-side error it could not map
        return True
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in _TRANSIENT_WORDS)


def with_retries(op: str, url: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried on transient errors with exponential backoff; :class:`StorageError` when exhausted."""
    delay = BACKOFF_S
    for attempt in range(RETRIES + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified below
            if not transient(e):
                raise
            if attempt == RETRIES:
                raise StorageError(f"{op} {url}: failed {RETRIES + 1} times (retried with backoff on throttling, "
                                   f"5xx and connection errors); last error: {type(e).__name__}: {e}. Check the "
                                   "object store is reachable, then save or load again.") from e
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


class ObjectFile:
    """An object opened for ranged reads (see :class:`.storage.RemoteReadable`)."""

    def __init__(self, fs: Any, path: str, url: str, size: int):
        self.fs, self.path, self.url, self.size = fs, path, url, size

    def readinto(self, bufs: list[memoryview], offset: int) -> None:
        global bytes_read
        n = sum(len(b) for b in bufs)
        if n == 0:
            return
        data = with_retries("read", self.url, lambda: self.fs.cat_file(self.path, start=offset, end=offset + n))
        if len(data) < n:
            raise CorruptCheckpointError(f"{self.url}: unexpected end of object at byte {offset + len(data)} "
                                         "(truncated)")
        with _count_lock:
            bytes_read += n
        view, pos = memoryview(data), 0
        for b in bufs:
            b[:] = view[pos:pos + len(b)].cast("B") if b.format == "B" else view[pos:pos + len(b)]
            pos += len(b)

    def close(self) -> None:
        pass


class ObjectStorage:
    """:class:`.storage.Storage` over one fsspec filesystem (chosen by the URL's scheme)."""

    remote = True

    def __init__(self, url: str):
        self.url = url
        self.fs, _ = filesystem(url)

    def _p(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def open_read(self, url: str, where: str) -> ObjectFile:
        size = self.size(url)
        if size is None:
            raise CorruptCheckpointError(f"{where}: object is missing (the checkpoint was replaced or deleted "
                                         "while being read, or copied incompletely)")
        return ObjectFile(self.fs, self._p(url), url, size)

    def write_file(self, url: str, body) -> int:
        """Upload ``url`` by streaming ``body`` (fsspec buffers it into multipart parts); retried whole."""
        path = self._p(url)

        def attempt() -> int:
            # parts of PART_BYTES (>= S3's 5 MiB minimum): each upload request carries whole CRC32 blocks
            with self.fs.open(path, "wb", block_size=PART_BYTES) as f:
                return body(f.write, lambda off, n: None)

        return with_retries("upload", url, attempt)

    def create_exclusive(self, url: str, data: bytes, exclusive: bool) -> None:
        """Write small object ``url`` in one request; ``exclusive``: fail with FileExistsError if it exists."""
        path = self._p(url)

        def attempt() -> None:
            with self.fs.open(path, "xb" if exclusive else "wb") as f:
                f.write(data)

        with_retries("publish", url, attempt)
        self.fs.invalidate_cache(path)

    def read_versioned(self, url: str, cap: int) -> tuple[bytes, str | None] | None:
        """``(body, token)`` of small object ``url``, None when absent. ``token`` is its ETag when the store reports
        one (s3fs), else None. The ETag is read *before* the body: if the object changes in between, the token is
        the older one and a conditional replace with it fails (a stale token can refuse, never overwrite)."""
        path = self._p(url)
        self.fs.invalidate_cache(path)
        try:
            info = with_retries("stat", url, lambda: self.fs.info(path))
        except FileNotFoundError:
            return None
        data = self.read_small(url, cap)
        if data is None:
            return None
        token = info.get("ETag") if self.conditional_replace else None
        return data, token if isinstance(token, str) and token else None

    @property
    def conditional_replace(self) -> bool:
        """Whether :meth:`replace_if` is a server-side compare-and-swap: s3fs passes ``IfMatch`` to PutObject
        (S3 and S3-compatible servers answer 412 when the ETag changed). Other filesystems (gcsfs, adlfs, memory://)
        get no precondition from us; callers fall back to re-reading the manifest just before the overwrite (see
        :mod:`._publish_remote`)."""
        protocol = self.fs.protocol
        return bool({"s3", "s3a"} & set((protocol,) if isinstance(protocol, str) else protocol))

    def replace_if(self, url: str, data: bytes, token: str | None) -> None:
        """Overwrite small object ``url`` in one PUT; with ``token`` only if its ETag still is ``token``.

        A failed condition raises FileExistsError (412; a 404 from ``If-Match`` on a deleted object likewise);
        transient errors are retried like every request (see :func:`with_retries`)."""
        path = self._p(url)

        def attempt() -> None:
            if token is None:
                self.fs.pipe_file(path, data)
                return
            try:  # chunksize >= len(data): one PutObject (IfMatch is not an argument of a multipart upload)
                self.fs.pipe_file(path, data, chunksize=max(len(data), 5 << 20), IfMatch=token)
            except FileNotFoundError:
                raise FileExistsError(f"{url}: deleted by another writer") from None
            except OSError as e:
                if precondition_failed(e):
                    raise FileExistsError(f"{url}: changed by another writer ({e})") from None
                raise

        with_retries("publish", url, attempt)
        self.fs.invalidate_cache(path)

    def put_file(self, local: str, url: str) -> None:
        """Upload local file ``local`` as object ``url`` (one object: visible whole at completion); retried."""
        with_retries("upload", url, lambda: self.fs.put_file(local, self._p(url)))
        self.fs.invalidate_cache(self._p(url))

    def get_file(self, url: str, local: str) -> None:
        """Download object ``url`` to local file ``local``; retried."""
        with_retries("download", url, lambda: self.fs.get_file(self._p(url), local))

    def read_small(self, url: str, cap: int) -> bytes | None:
        """The whole object ``url`` (at most ``cap`` bytes, else CorruptCheckpointError), None when absent."""
        size = self.size(url)
        if size is None:
            return None
        if size > cap:
            raise CorruptCheckpointError(f"{url}: {size} bytes exceeds the {cap}-byte cap")
        global bytes_read
        data = with_retries("read", url, lambda: self.fs.cat_file(self._p(url)))
        with _count_lock:
            bytes_read += len(data)
        return data

    def size(self, url: str) -> int | None:
        path = self._p(url)
        self.fs.invalidate_cache(path)  # another process may have written it since this one listed
        try:
            info = with_retries("stat", url, lambda: self.fs.info(path))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") != "directory" else None

    def listdir(self, url: str) -> list[str]:
        path = self._p(url)
        self.fs.invalidate_cache(path)
        try:
            entries = with_retries("list", url, lambda: self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != base})

    def isdir(self, url: str) -> bool:
        return bool(self.listdir(url))

    def remove_tree(self, url: str) -> None:
        path = self._p(url)
        try:
            with_retries("delete", url, lambda: self.fs.rm(path, recursive=True))
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(path)


def precondition_failed(e: BaseException) -> bool:
    """Whether ``e`` (or what it was translated from) is S3's 412 PreconditionFailed or 409
    ConditionalRequestConflict: a conditional write lost to another writer."""
    for x in (e, e.__cause__, e.__context__):
        response = getattr(x, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
            return True
    return "precondition" in str(e).lower()


def is_save_prefix(name: str) -> bool:
    """Whether ``name`` (an entry of a checkpoint prefix) is one save's object prefix (a uuid hex)."""
    return bool(_UID.match(name))


def check_uid(uid, where: str) -> str:
    if not (isinstance(uid, str) and is_save_prefix(uid)):
        raise CorruptCheckpointError(f"{where}: invalid uuid {uid!r} (a checkpoint on an object store keeps its "
                                     "objects under the prefix named by the manifest's uuid)")
    return uid
