"""The safetensors header exactly as the ``safetensors`` library (0.8, Rust core) writes it, from names, dtypes
and shapes alone, so the file's layout is known before any data exists and every rank can ``pwrite`` its own
byte ranges into a file that is byte-identical to ``safetensors.torch.save_file`` of the whole tensors.

The library's rules, checked against it by ``tests/test_export_ranged.py``: tensors are laid out by dtype
(descending in the order of :data:`_DTYPE_ORDER`, the library's ``Dtype`` enum), then by name; the header is
compact JSON (``__metadata__`` first when given, even empty; non-ASCII names as raw UTF-8), padded with spaces
to a multiple of 8 bytes; data follows with no gaps. One thing the library does not fix: with more than one
metadata key it orders them by a per-process seeded hash, so two of its own saves differ there; we keep the
given order (transformers, PEFT and accelerate all write the one key ``format``).
"""
from __future__ import annotations

import json
import struct

from . import _format
from ..errors import CheckpointError

#: safetensors' ``Dtype`` enum order, ascending (tensors are written in the reverse of it).
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16",
                "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64")
_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}


def data_order(entries: list[tuple[str, str, tuple]]) -> list[tuple[str, str, tuple]]:
    """``(name, dtype_name, shape)`` in the order safetensors lays their data out."""
    for name, dt, _ in entries:
        if dt not in _RANK:
            raise CheckpointError(f"tensor {name!r}: dtype {dt} has no place in safetensors' layout order; "
                                  "save it in a dtype safetensors.torch supports")
    return sorted(entries, key=lambda e: (-_RANK[e[1]], e[0]))


def encode(entries: list[tuple[str, str, tuple]], metadata: dict[str, str] | None) -> tuple[bytes, dict, int]:
    """``(header_bytes, {name: absolute byte offset}, file_size)`` for ``entries`` (any order)."""
    doc: dict[str, object] = {} if metadata is None else {"__metadata__": dict(metadata)}
    pos, rel = 0, {}
    for name, dt, shape in data_order(entries):
        nbytes = _format.numel(shape) * _format.itemsize(dt)
        doc[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    start = 8 + len(body)
    return struct.pack("<Q", len(body)) + body, {n: start + r for n, r in rel.items()}, start + pos
