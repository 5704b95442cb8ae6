"""The zip archive ``torch.save`` writes, laid out before its tensor bytes exist.

``torch.save`` under ``torch.serialization.skip_data(materialize_fake_tensors=True)`` with fake tensors (shapes
and dtypes, no memory) writes the whole archive (``data.pkl`` and the other records, each storage record at its
final size and 64-byte-aligned offset) but leaves every storage record's bytes empty and its CRC32 zero.
:func:`records` finds each record's data offset; once every rank has written its bytes there,
:func:`fix_crcs` streams each record back (``_READ`` bytes at a time), computes its CRC32 and writes it into the
record's data descriptor and central-directory entry, so ``zipfile``, ``torch.load`` and Lightning read the
file like any ``torch.save`` output.
"""
from __future__ import annotations

import os
import struct
import zipfile

from ..errors import CheckpointError
from ..storage.fsio import crc32

_READ = 1 << 20
_LOCAL, _CENTRAL, _DESCRIPTOR = 0x04034B50, 0x02014B50, 0x08074B50


def records(path: str) -> dict[str, tuple[int, int]]:
    """``{record name without the archive's folder: (absolute data offset, size in bytes)}``."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
        for info in zf.infolist():
            f.seek(info.header_offset)
            _, name_len, extra_len = _local_header(f.read(30), info.filename)
            short = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
            out[short] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


def fix_crcs(path: str, names: list[str]) -> None:
    """Compute and store the CRC32 of records ``names`` (as :func:`records` names them) from the file's bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
            infos = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
            central = _central_offsets(fd, zf.start_dir, len(zf.infolist()), path)
        offsets = records(path)
        buf = bytearray(_READ)  # one reused read buffer: memory O(_READ)
        for name in names:
            info = infos[name]
            start, size = offsets[name]
            crc = _crc(fd, start, size, buf)
            if info.flag_bits & 0x08:  # the CRC lives in the data descriptor after the data
                if struct.unpack("<I", os.pread(fd, 4, start + size))[0] != _DESCRIPTOR:
                    raise CheckpointError(f"{path}: record {name!r} has no data descriptor where torch puts it")
                _put(fd, crc, start + size + 4)
            else:
                _put(fd, crc, info.header_offset + 14)
            _put(fd, crc, central[info.filename] + 16)
        os.fsync(fd)
    finally:
        os.close(fd)


def _put(fd: int, crc: int, pos: int) -> None:
    if os.pwrite(fd, struct.pack("<I", crc), pos) != 4:
        raise OSError(f"short write of a CRC at byte {pos}")


def _local_header(raw: bytes, name: str) -> tuple[int, int, int]:
    sig, *_, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", raw)
    if sig != _LOCAL:
        raise CheckpointError(f"record {name!r}: no zip local header at its offset")
    return sig, name_len, extra_len


def _central_offsets(fd: int, start: int, count: int, path: str) -> dict[str, int]:
    """``{record name: offset of its central-directory entry}``."""
    out, pos = {}, start
    for _ in range(count):
        raw = os.pread(fd, 46, pos)
        sig, = struct.unpack("<I", raw[:4])
        if sig != _CENTRAL:
            raise CheckpointError(f"{path}: central directory damaged at byte {pos}")
        name_len, extra_len, comment_len = struct.unpack("<HHH", raw[28:34])
        out[os.pread(fd, name_len, pos + 46).decode()] = pos
        pos += 46 + name_len + extra_len + comment_len
    return out


def _crc(fd: int, start: int, size: int, buf: bytearray) -> int:
    crc, pos, end = 0, start, start + size
    while pos < end:
        n = os.preadv(fd, [memoryview(buf)[: min(len(buf), end - pos)]], pos)
        if n <= 0:
            raise CheckpointError(f"record at byte {start}: the file ends before its {size} bytes")
        crc = crc32(memoryview(buf)[:n], crc)
        pos += n
    return crc
