"""The safetensors container: dtype names, header encoding, and a strict header parser.

File layout (safetensors spec): ``u64 little-endian N`` | ``N bytes of UTF-8 JSON`` | data buffer.
The JSON maps a tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets in
bytes relative to the data buffer (which starts at file offset ``8 + N``); ``__metadata__`` is a
string→string map. Our writer pads the JSON with spaces so the data starts at a multiple of 4096 bytes
(legal: trailing spaces are valid JSON).

The parser never uses pickle, bounds the header length, rejects duplicate keys, NaN constants, unknown
dtypes, bad shapes, and offsets that overlap, leave holes or do not cover the file exactly.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from ...errors import CodecError
from ..errors import CorruptCheckpointError

#: safetensors dtype name -> torch dtype (only those torch has).
_NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "C64": torch.complex64,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E8M0", "float8_e8m0fnu"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        _NAME_TO_DTYPE[_name] = getattr(torch, _attr)
_DTYPE_TO_NAME = {v: k for k, v in _NAME_TO_DTYPE.items()}

#: Largest header we parse (bytes); the safetensors Rust reader uses the same cap.
MAX_HEADER_BYTES = 100_000_000
#: Data start alignment of files we write (bytes).
DATA_ALIGN = 4096
#: Largest element count we accept for one tensor (guards against overflowing shapes).
MAX_NUMEL = 1 << 50


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors name of a torch dtype (``torch.float32 -> "F32"``)."""
    try:
        return _DTYPE_TO_NAME[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} cannot be stored in safetensors") from None


def to_dtype(name: str) -> torch.dtype:
    """torch dtype of a safetensors name; ``KeyError`` if unknown."""
    return _NAME_TO_DTYPE[name]


def known_dtype(name) -> bool:
    return isinstance(name, str) and name in _NAME_TO_DTYPE


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    return _NAME_TO_DTYPE[name].itemsize


def numel(shape) -> int:
    return math.prod(shape)


def strict_json_loads(text: str | bytes, what: str):
    """``json.loads`` that rejects duplicate keys and NaN/Infinity; errors name ``what``."""

    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise CorruptCheckpointError(f"{what}: duplicate key {k!r}")
            out[k] = v
        return out

    def bad_constant(c):
        raise CorruptCheckpointError(f"{what}: non-finite number {c} is not allowed")

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=bad_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{what}: invalid JSON ({e})") from None


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file. ``begin``/``end``: absolute file offsets in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: ``data_start`` is the file offset of the data buffer (bytes)."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None,
                  align: int = DATA_ALIGN) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for ``(name, dtype_name, shape)`` in that data order.

    Returns ``(header_bytes, offsets)``: ``offsets[i]`` is tensor i's absolute file offset in bytes;
    ``len(header_bytes)`` is a multiple of ``align`` (8 at least) and is where the data begins.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    rel = []
    for name, dt, shape in tensors:
        nbytes = numel(shape) * itemsize(dt)
        doc[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel.append(pos)
        pos += nbytes
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    total = -(-(8 + len(body)) // align) * align
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body, [total + r for r in rel]


def read_header(fd: int, file_size: int, where: str) -> Header:
    """Parse and validate the safetensors header of open file ``fd`` (``file_size`` bytes).

    Raises :class:`CorruptCheckpointError` naming ``where`` for any structural damage.
    """
    if file_size < 8:
        raise CorruptCheckpointError(f"{where}: {file_size} bytes is too small for a safetensors file")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, where))
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise CorruptCheckpointError(f"{where}: header length {n} runs past the end of the "
                                     f"{file_size}-byte file (truncated?)")
    raw = _pread_exact(fd, n, 8, where)
    doc = strict_json_loads(raw, f"{where} header")
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    return _validate_header(doc, 8 + n, file_size, where)


def _validate_header(doc: dict, data_start: int, file_size: int, where: str) -> Header:
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{where}: __metadata__ must map strings to strings")
    entries = {}
    for name, info in doc.items():
        entries[name] = _validate_entry(name, info, data_start, where)
    pos = data_start
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            kind = "overlaps the previous tensor" if e.begin < pos else "leaves a hole before it"
            raise CorruptCheckpointError(f"{where}: tensor {e.name!r} {kind} (byte {e.begin}, expected {pos})")
        pos = e.end
    if pos != file_size:
        raise CorruptCheckpointError(f"{where}: tensors end at byte {pos} but the file has {file_size} bytes "
                                     "(truncated or extended)")
    return Header(entries, dict(meta), data_start)


def _validate_entry(name: str, info, data_start: int, where: str) -> Entry:
    ok = (isinstance(info, dict) and known_dtype(info.get("dtype")) and isinstance(info.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(type(o) is int and o >= 0 for o in info["data_offsets"]))
    if not ok:
        raise CorruptCheckpointError(f"{where}: invalid header entry for tensor {name!r}: {info!r:.200}")
    n = numel(info["shape"])
    b, e = info["data_offsets"]
    if n > MAX_NUMEL or e - b != n * itemsize(info["dtype"]):
        raise CorruptCheckpointError(f"{where}: tensor {name!r}: shape {info['shape']} and dtype "
                                     f"{info['dtype']} do not match data_offsets {info['data_offsets']}")
    return Entry(name, info["dtype"], tuple(info["shape"]), data_start + b, data_start + e)


def _pread_exact(fd, n: int, offset: int, where: str) -> bytes:
    if not isinstance(fd, int):  # an object-store handle (see .storage): one ranged read
        out = bytearray(n)
        if n:
            fd.readinto([memoryview(out)], offset)
        return bytes(out)
    buf = os.pread(fd, n, offset)
    if len(buf) != n:
        raise CorruptCheckpointError(f"{where}: expected {n} bytes at offset {offset}, got {len(buf)} (truncated)")
    return buf
