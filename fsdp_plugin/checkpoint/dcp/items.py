"""The items of DCP's ``.distcp`` files, read without ``torch.load`` or a general unpickler.

Each item (one tensor chunk or one non-tensor value) is a complete ``torch.save`` zip archive at a byte
range of its data file. Records are ZIP_STORED, so a tensor's bytes are the raw little-endian storage
``<prefix>/data/<key>``; :func:`tensor_header` locates them from the zip directory and the small
``data.pkl`` (parsed by :class:`_TensorUnpickler`, which admits only torch's rebuild functions, storage
classes, dtypes and ``OrderedDict``). :func:`read_value` unpickles a non-tensor value with no globals at
all (plain Python values: every optimizer hyper-parameter torch writes).
"""
from __future__ import annotations

import io
import pickle
import struct
import zipfile
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from ..storage.fsio import pread
from .metadata import DTYPES

#: Largest ``data.pkl`` / value record we read (bytes).
MAX_PICKLE_BYTES = 64 << 20

_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
             "ComplexDoubleStorage": torch.complex128}


@dataclass(frozen=True)
class TensorHeader:
    """Where a chunk's elements are: ``data_offset`` is the absolute file offset (bytes) of its storage,
    which holds ``storage_numel`` elements of ``dtype``; the chunk is ``as_strided(size, stride,
    storage_offset)`` of it (elements)."""

    dtype: torch.dtype
    size: tuple
    stride: tuple
    storage_offset: int
    storage_numel: int
    data_offset: int
    crc32: int          # zip CRC-32 of the whole storage record

    @property
    def contiguous(self) -> bool:
        """Row-major with no offset: element ``i`` of the flattened chunk is storage element ``i``."""
        expect, acc = [], 1
        for d in reversed(self.size):
            expect.append(acc)
            acc *= d
        dims = [(s, e) for s, e, n in zip(self.stride, reversed(expect), self.size) if n > 1]
        return self.storage_offset == 0 and all(s == e for s, e in dims)


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open fd as a seekable read-only file (``pread``)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        data = pread(self.fd, n, self.base + self.pos) if n else b""
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _archive(fd: int, offset: int, length: int, where: str) -> tuple[zipfile.ZipFile, str]:
    """The item's zip (directory only) and its record prefix (``archive`` for DCP's saves)."""
    try:
        zf = zipfile.ZipFile(io.BufferedReader(_Window(fd, offset, length)))
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as e:
        raise CorruptCheckpointError(f"{where}: not a torch.save archive ({e}): the file is damaged or truncated. "
                                     "Copy the checkpoint again, or load the previous one.") from None
    pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise CorruptCheckpointError(f"{where}: the archive has no single data.pkl record")
    return zf, pkl[0][: -len("/data.pkl")]


def _record(zf: zipfile.ZipFile, name: str, where: str) -> bytes:
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CorruptCheckpointError(f"{where}: the archive lacks record {name}") from None
    if info.file_size > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"{where}: record {name} is {info.file_size:,} bytes, over the cap")
    try:
        return zf.read(info)  # verifies the record's CRC32
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, NotImplementedError) as e:
        raise CorruptCheckpointError(f"{where}: record {name} is damaged ({e}). Copy the checkpoint again, "
                                     "or load the previous one.") from None


def _rebuild_v2(storage, storage_offset, size, stride, *_):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), None)


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_):
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride), dtype)


_TENSOR_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2, ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
                   ("torch.storage", "UntypedStorage"): "untyped", ("collections", "OrderedDict"): dict}


class _TensorUnpickler(pickle.Unpickler):
    """``data.pkl`` of a saved tensor: only rebuild functions, storages, dtypes and ``OrderedDict``."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return ("storage", name)
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        hit = _TENSOR_GLOBALS.get((module, name))
        if hit is None:
            raise UnsafeCheckpointError(f"{self.where}: the tensor record names {module}.{name}; refusing to "
                                        "unpickle it (a DCP tensor item only names torch's rebuild functions)")
        return hit

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[2], str)
                and type(pid[4]) is int):
            raise CorruptCheckpointError(f"{self.where}: unexpected storage reference {pid!r}")
        return pid[1], pid[2], pid[4]


def tensor_header(fd: int, offset: int, length: int, where: str) -> TensorHeader:
    """Parse the tensor item at bytes ``[offset, offset + length)``: dtype, layout and storage location."""
    zf, prefix = _archive(fd, offset, length, where)
    order = zf.read(f"{prefix}/byteorder") if f"{prefix}/byteorder" in zf.namelist() else b"little"
    if order.strip() != b"little":
        raise CorruptCheckpointError(f"{where}: stored {order!r}-endian; only little-endian items are read")
    try:
        obj = _TensorUnpickler(_record(zf, f"{prefix}/data.pkl", where), where).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle
        raise CorruptCheckpointError(f"{where}: unreadable tensor record ({type(e).__name__}: {e})") from None
    if not (isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "tensor"):
        raise CorruptCheckpointError(f"{where}: the item is not a tensor")
    _, (stype, key, numel), storage_offset, size, stride, dtype = obj
    dtype, numel = _storage_dtype(stype, dtype, numel, where)
    name = f"{prefix}/data/{key}"
    start = _data_start(fd, offset, zf, name, numel * dtype.itemsize, where)
    return TensorHeader(dtype, size, stride, storage_offset, numel, offset + start, zf.getinfo(name).CRC)


def _storage_dtype(stype, dtype, numel: int, where: str) -> tuple[torch.dtype, int]:
    """dtype and element count of a storage (an ``UntypedStorage`` counts bytes)."""
    if stype == "untyped":
        if not isinstance(dtype, torch.dtype) or numel % dtype.itemsize:
            raise CorruptCheckpointError(f"{where}: untyped storage without a usable dtype")
        return dtype, numel // dtype.itemsize
    if not (isinstance(stype, tuple) and stype[0] == "storage"):
        raise CorruptCheckpointError(f"{where}: unknown storage type {stype!r}")
    return _STORAGES[stype[1]], numel


def _data_start(fd: int, offset: int, zf: zipfile.ZipFile, name: str, nbytes: int, where: str) -> int:
    """Offset (bytes, relative to the item) of record ``name``'s data; checks it is stored and sized."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise CorruptCheckpointError(f"{where}: the archive lacks record {name}") from None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        raise CorruptCheckpointError(f"{where}: record {name} is compressed or has {info.file_size} bytes "
                                     f"(expected {nbytes} stored)")
    local = pread(fd, 30, offset + info.header_offset)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise CorruptCheckpointError(f"{where}: damaged zip header of {name}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


class _ValueUnpickler(pickle.Unpickler):
    """A non-tensor value: plain Python objects only (``OrderedDict`` read as ``dict``)."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise UnsafeCheckpointError(f"{self.where}: the value names {module}.{name}; refusing to unpickle it "
                                    "(only plain Python values are read from a DCP checkpoint)")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"{self.where}: the value holds a tensor or storage; refusing to unpickle it")


def read_value(fd: int, offset: int, length: int, where: str):
    """The non-tensor value stored at bytes ``[offset, offset + length)`` (see :class:`_ValueUnpickler`)."""
    zf, prefix = _archive(fd, offset, length, where)
    data = _record(zf, f"{prefix}/data.pkl", where)
    try:
        return _ValueUnpickler(data, where).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle
        raise CorruptCheckpointError(f"{where}: unreadable value ({type(e).__name__}: {e})") from None
