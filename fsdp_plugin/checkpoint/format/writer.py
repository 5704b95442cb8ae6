"""Stream tensors into a new safetensors file straight from their memory, with block CRC32s and fsync.

No serialization buffer: the header is encoded up front, then every tensor's bytes are written with
``os.write`` (on an object store: the upload stream, see :mod:`.storage`) from the tensor's own memory (a
device tensor is first copied to the CPU, one tensor at a time), in cache-sized chunks that are checksummed just before they are written. The data start is padded to 4096 bytes. The file is created exclusively (mode 0644 & ~umask)
and fsynced before this returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _format
from ..storage import fsio
from ..storage.fsio import BlockCrc, byte_view
from ..storage import storage_for


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records about one written file (sizes in bytes)."""

    bytes: int
    data_start: int
    block_bytes: int
    crc32: tuple[int, ...]

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "data_start": self.data_start, "block_bytes": self.block_bytes,
                "crc32": list(self.crc32)}


def flat_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D CPU tensor (a view when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1)


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor, tuple[int, ...]]],
                      metadata: dict[str, str] | None = None, block_bytes: int | None = None) -> FileRecord:
    """Write ``(name, tensor, stored_shape)`` triples, in that order, to a new file at ``path``.

    ``stored_shape`` must have ``tensor.numel()`` elements (a 1-D piece is stored as ``(numel,)``).
    ``block_bytes``: CRC32 block size (default :data:`fsio.BLOCK_BYTES`, read at call time).
    """
    block_bytes = block_bytes or fsio.BLOCK_BYTES
    spec = []
    for name, t, shape in tensors:
        assert _format.numel(shape) == t.numel(), f"{name}: shape {shape} vs {t.numel()} elements"
        spec.append((name, _format.dtype_name(t.dtype), tuple(shape)))
    header, _ = _format.encode_header(spec, metadata)
    crcs: list[int] = []

    def body(write, hint) -> int:  # may run again when an object-store upload is retried: fresh CRC state
        crc = BlockCrc(block_bytes)
        size = _write_chunks(write, hint, header, tensors, crc)
        crcs[:] = crc.finish()
        return size

    size = storage_for(path).write_file(path, body)
    return FileRecord(size, len(header), block_bytes, tuple(crcs))


def _write_chunks(write, hint, header: bytes, tensors: list, crc: BlockCrc) -> int:
    """Checksum then write each chunk while it is still in cache (measured: ~35% less CPU than whole tensors)."""
    _write_and_crc(write, memoryview(header), crc)
    size = flushed = len(header)
    for _, t, _ in tensors:
        flat = flat_cpu(t)  # keeps a temporary host copy alive while its view is written
        view = byte_view(flat)
        for pos in range(0, len(view), CHUNK_BYTES):
            chunk = view[pos:pos + CHUNK_BYTES]
            _write_and_crc(write, chunk, crc)
            size += len(chunk)
            if size - flushed >= fsio.WRITEBACK_BYTES:
                hint(flushed, size - flushed)
                flushed = size
    return size


#: Chunk size (bytes): fits an L2 cache, so ``write`` copies what the CRC just read.
CHUNK_BYTES = 1 << 20


def _write_and_crc(write, data: memoryview, crc: BlockCrc) -> None:
    crc.update(data)
    write(data)
