"""Exception hierarchy of the checkpoint package.

Every error names the file (and, where one is involved, the tensor and byte range) and says what to do.

    FSDPPluginError
    └── CheckpointError                      base class; also raised for unsafe paths
        ├── CorruptCheckpointError           bytes on disk are damaged: size, header, CRC32, manifest
        │   └── IncompleteCheckpointError    evidence of an interrupted save (see checkpoint/format/layouts.py)
        │   └── UnsafeCheckpointError        a foreign pickle names a global outside the allow-list
        ├── CheckpointMismatchError          a valid checkpoint that does not fit the model/optimizer
        │   ├── CheckpointKeyError (KeyError)            an entry the state to load needs is absent
        │   └── StateMismatchError (RuntimeError)        saved and prepared objects differ in number
        ├── CheckpointStateError (ValueError)            not a checkpoint of this kind (e.g. no Lightning state)
        ├── CheckpointNotFoundError (FileNotFoundError)  a checkpoint file or directory is missing
        ├── UnsupportedStorageError (ConfigError)        a URL whose scheme has no filesystem here / no URL support
        └── StorageError (OSError)                       an object store kept failing after bounded retries
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, FSDPPluginError


class CheckpointError(FSDPPluginError):
    """Base class of every checkpoint error (also: unsafe path, unsupported format version)."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is damaged (truncated, bad header, CRC32 failure, invalid manifest)."""


class IncompleteCheckpointError(CorruptCheckpointError):
    """The save that produced the directory was interrupted: a temporary sibling or rank files without manifest.json."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A pickle in a foreign checkpoint (DCP ``.metadata``, a ``.distcp`` item) names a global off the allow-list.

    It is refused, never unpickled (persistent ids outside a tensor record likewise)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is valid but does not match the model or optimizer it is loaded into.

    ``report`` is a :class:`MismatchReport` with the missing, unexpected and mismatched names.
    """

    def __init__(self, message: str, report: MismatchReport | None = None):
        super().__init__(message)
        self.report = report


class CheckpointKeyError(CheckpointMismatchError, KeyError):
    """The checkpoint lacks an entry (module, optimizer, tensor) that the state being loaded needs."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StateMismatchError(CheckpointMismatchError, RuntimeError):
    """Saved and prepared objects (schedulers, custom objects) differ in number."""


class CheckpointStateError(CheckpointError, ValueError):
    """The path holds something else than the checkpoint kind asked for (another writer, no trainer state)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A file or directory the checkpoint needs does not exist."""


class UnsupportedStorageError(CheckpointError, ConfigError):
    """A path is a URL (``s3://``, ``gs://``...) that cannot be used here: no fsspec filesystem is installed for its
    scheme, or this entry point reads local directories only. The message names the scheme and the fix."""


class StorageError(CheckpointError, OSError):
    """An object-store request kept failing (throttling, 5xx, connection) after bounded retries with backoff.

    The message names the URL, the operation, the number of attempts and the last error."""


class CheckpointMismatchWarning(UserWarning):
    """Emitted by a non-strict load that skipped names; ``.report`` holds the :class:`MismatchReport`."""

    def __init__(self, message: str, report: MismatchReport):
        super().__init__(message)
        self.report = report


@dataclass
class MismatchReport:
    """What a non-strict load skipped.

    missing: names the model has and the checkpoint lacks (left untouched).
    unexpected: names the checkpoint has and the model lacks (ignored).
    mismatched: ``name -> "checkpoint shape/dtype vs model shape/dtype"`` (left untouched).
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def describe(self, limit: int = 20) -> str:
        """One human-readable paragraph, at most ``limit`` names per category."""
        parts = []
        for label, names in (("missing from the checkpoint", self.missing),
                             ("unexpected (not in the model)", self.unexpected)):
            if names:
                more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
                parts.append(f"{label}: {', '.join(names[:limit])}{more}")
        if self.mismatched:
            items = [f"{k} ({v})" for k, v in list(self.mismatched.items())[:limit]]
            parts.append("shape/dtype mismatch: " + ", ".join(items))
        return "; ".join(parts)

    def extend(self, other: MismatchReport, prefix: str = "") -> None:
        """Merge ``other`` into this report, prefixing its names with ``prefix``."""
        self.missing += [prefix + n for n in other.missing]
        self.unexpected += [prefix + n for n in other.unexpected]
        self.mismatched.update({prefix + k: v for k, v in other.mismatched.items()})
