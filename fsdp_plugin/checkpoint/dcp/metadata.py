"""Read DCP's ``.metadata`` (a pickle) with an allow-list: only DCP's own metadata classes, as stand-ins.

``torch.distributed.checkpoint`` writes ``pickle.dump(Metadata(...))``. We never let that pickle name an
arbitrary global: :class:`_MetadataUnpickler` maps exactly the globals DCP's writer emits (its metadata
dataclasses, ``_StorageInfo``, ``torch.Size``, the layout/dtype reducers, ``pathlib`` paths) to plain
stand-ins defined here, and refuses everything else with :class:`UnsafeCheckpointError`. No persistent
ids are allowed. The result is a validated :class:`DcpMetadata`: tensors as N-D chunk boxes with their
byte range in a data file, and non-tensor ("bytes") entries.
"""
from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass, field

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..storage import join, storage_for
from ..storage.fsio import check_plain_name
from ..format.layouts import METADATA_FILE

#: Largest ``.metadata`` we parse (bytes): ~350 B per key, so 1 GiB covers millions of keys.
MAX_METADATA_BYTES = 1 << 30

#: dtype names a DCP checkpoint may name (``torch.<name>``); only those this torch has are accepted.
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "complex32", "float8_e4m3fn",
                "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}


class _Record:
    """Stand-in for a pickled dataclass: ``BUILD`` sets its fields (a dict, or ``(dict, slots)``)."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"{type(self).__name__}: unexpected pickled state {type(state).__name__}")
        self.__dict__.update(state)


class _Metadata(_Record):
    pass


class _TensorStorage(_Record):
    pass


class _BytesStorage(_Record):
    pass


class _Chunk(_Record):
    pass


class _StorageMeta(_Record):
    pass


class _StorageInfo(_Record):
    pass


class _TensorProperties(_Record):
    """``TensorProperties`` pickles as ``(dtype, layout, requires_grad, memory_format, pin_memory)``."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype = state[0]
        else:
            super().__setstate__(state)


class _Index(_Record):
    """``MetadataIndex(fqn, offset, index)``: looked up by ``(fqn, offset)`` (``index`` is only a hint)."""

    def key(self) -> tuple:
        off = getattr(self, "offset", None)
        return getattr(self, "fqn", None), None if off is None else tuple(off)


def _path(*parts) -> str:
    return os.path.join(*map(str, parts))


_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_MD, "Metadata"): _Metadata, (_MD, "TensorStorageMetadata"): _TensorStorage,
    (_MD, "BytesStorageMetadata"): _BytesStorage, (_MD, "ChunkStorageMetadata"): _Chunk,
    (_MD, "MetadataIndex"): _Index, (_MD, "StorageMeta"): _StorageMeta, (_MD, "TensorProperties"): _TensorProperties,
    (_MD, "_MEM_FORMAT_ENCODING"): int,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): tuple, ("torch.serialization", "_get_layout"): str,
    ("pathlib", "PosixPath"): _path, ("pathlib", "WindowsPath"): _path, ("pathlib", "Path"): _path,
    ("pathlib._local", "PosixPath"): _path, ("pathlib._local", "WindowsPath"): _path,
    ("pathlib._local", "Path"): _path,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals of :data:`_ALLOWED` and ``torch.<dtype>``; no persistent ids."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if module == "torch" and name in DTYPES:
            return ("dtype", name)
        hit = _ALLOWED.get((module, name))
        if hit is None:
            raise UnsafeCheckpointError(
                f"{self.where}: the pickle names {module}.{name}, which is not one of DCP's metadata classes; "
                "refusing to unpickle it. Only a .metadata written by torch.distributed.checkpoint.save is "
                "read: if this directory came from elsewhere, do not load it.")
        return hit

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where}: the pickle uses a persistent id; DCP metadata never does")


@dataclass(frozen=True)
class Chunk:
    """One saved box of a tensor: ``offsets``/``sizes`` per dimension, bytes ``[offset, offset+length)`` of
    ``file`` (a ``torch.save`` zip archive holding the box)."""

    offsets: tuple
    sizes: tuple
    file: str
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorEntry:
    """A tensor of the checkpoint in ``directory``: global ``size``, ``dtype`` and its saved chunks."""

    dtype: torch.dtype
    size: tuple
    directory: str
    chunks: list = field(default_factory=list)


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor value: a ``torch.save`` pickle of it at bytes ``[offset, offset+length)`` of
    ``directory/file``."""

    directory: str
    file: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    """A validated ``.metadata``: ``entries`` maps each flat key to a :class:`TensorEntry` or
    :class:`BytesEntry`; ``paths`` maps it to its path in the nested state dict (``planner_data``), or to
    ``(key,)`` when the checkpoint was saved without flattening."""

    directory: str
    entries: dict
    paths: dict


def read_metadata(directory: str) -> DcpMetadata:
    """Parse and validate ``directory/.metadata`` (see module docstring)."""
    where = join(directory, METADATA_FILE)
    raw = _read_capped(where)
    try:
        md = _MetadataUnpickler(raw, where).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure of a damaged file
        raise CorruptCheckpointError(f"{where} is not a readable DCP metadata file ({type(e).__name__}: {e}): "
                                     "the checkpoint is damaged or truncated. Copy it again, or load the "
                                     "previous one.") from None
    if not isinstance(md, _Metadata):
        raise CorruptCheckpointError(f"{where} does not hold DCP Metadata (found {type(md).__name__})")
    return _validate(md, directory, where)


def _read_capped(where: str) -> bytes:
    """The whole file (or object, at a URL) ``where``, at most :data:`MAX_METADATA_BYTES`."""
    st = storage_for(where)
    size = st.size(where)
    if size is None:
        from ..errors import IncompleteCheckpointError

        raise IncompleteCheckpointError(f"{where} is missing: the DCP save that wrote this directory did not "
                                        "finish. Load the previous checkpoint.") from None
    if size > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where} is {size:,} bytes, over the {MAX_METADATA_BYTES:,}-byte cap")
    if st.remote:
        return st.read_small(where, MAX_METADATA_BYTES)
    with open(where, "rb") as f:
        return f.read()


def _validate(md: _Metadata, directory: str, where: str) -> DcpMetadata:
    storage = _storage_index(getattr(md, "storage_data", None), where)
    planner = getattr(md, "planner_data", None) or {}
    entries, paths = {}, {}
    for key, meta in (getattr(md, "state_dict_metadata", None) or {}).items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where}: state dict key {key!r} is not a string")
        if isinstance(meta, _BytesStorage):
            info = storage.get((key, None))
            if info is None:
                raise CorruptCheckpointError(f"{where}: value {key!r} has no storage record")
            entries[key] = BytesEntry(directory, *info)
        elif isinstance(meta, _TensorStorage):
            entries[key] = _tensor_entry(key, meta, storage, directory, where)
        else:
            raise CorruptCheckpointError(f"{where}: entry {key!r} has unknown metadata {type(meta).__name__}")
        path = planner.get(key, (key,))
        if not (isinstance(path, tuple) and path and all(isinstance(p, (str, int)) for p in path)):
            raise CorruptCheckpointError(f"{where}: planner path of {key!r} is {path!r}")
        paths[key] = path
    return DcpMetadata(directory, entries, paths)


def _storage_index(data, where: str) -> dict:
    """``{(fqn, offsets-or-None): (file, offset, length)}`` from ``storage_data``, validated."""
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: storage_data is missing (not a FileSystemWriter checkpoint?)")
    out = {}
    for idx, info in data.items():
        if not isinstance(idx, _Index) or not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{where}: malformed storage_data entry")
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(
                f"{where}: {idx.fqn!r} is stored with transforms {info.transform_descriptors} (DCP's experimental "
                "compression extensions); re-save without _extensions to load it here")
        rel, off, length = getattr(info, "relative_path", None), getattr(info, "offset", None), \
            getattr(info, "length", None)
        if not (isinstance(rel, str) and type(off) is int and type(length) is int and off >= 0 and length > 0):
            raise CorruptCheckpointError(f"{where}: storage record of {idx.fqn!r} is invalid")
        check_plain_name(rel, where)
        out[idx.key()] = (rel, off, length)
    return out


def _tensor_entry(key: str, meta: _TensorStorage, storage: dict, directory: str, where: str) -> TensorEntry:
    props = getattr(meta, "properties", None)
    dt = getattr(props, "dtype", None)
    if not (isinstance(dt, tuple) and dt[0] == "dtype" and dt[1] in DTYPES):
        raise CorruptCheckpointError(f"{where}: tensor {key!r} has no supported dtype ({dt!r})")
    size = _dims(getattr(meta, "size", None), key, where)
    entry = TensorEntry(DTYPES[dt[1]], size, directory)
    for c in getattr(meta, "chunks", None) or []:
        offsets, sizes = _dims(getattr(c, "offsets", None), key, where), _dims(getattr(c, "sizes", None), key, where)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CorruptCheckpointError(f"{where}: chunk {offsets}+{sizes} of {key!r} exceeds its size {size}")
        info = storage.get((key, offsets))
        if info is None:
            raise CorruptCheckpointError(f"{where}: chunk at {offsets} of {key!r} has no storage record")
        entry.chunks.append(Chunk(offsets, sizes, *info))
    return entry


def _dims(value, key: str, where: str) -> tuple:
    if not (isinstance(value, tuple) and all(type(d) is int and d >= 0 for d in value)):
        raise CorruptCheckpointError(f"{where}: tensor {key!r} has an invalid shape {value!r}")
    return value
