"""Exact-range reads from safetensors files straight into destination tensors.

Usage: ``plan = ReadPlan(dir, records)``; ``plan.header(name)`` validates a file; ``plan.add(...)``
queues "read ``n`` elements at byte ``offset`` of file ``name`` into 1-D tensor ``dest``";
``plan.execute()`` performs them. Invariants:

* bytes are read with ``preadv`` into the destination's own memory when it is a contiguous CPU tensor
  of the stored dtype; otherwise through a bounce buffer of at most ``BOUNCE_BYTES`` per run (cast,
  device copy). No mmap (it over-reads, pins the page cache and dies with SIGBUS on truncation).
* for files with a manifest record, the size is checked before any read and the CRC32 of every block a
  read touches is verified (reads are widened to block boundaries, at most 2 extra blocks per run).
* nothing outside the checkpoint directory is opened (see :func:`fsio.open_in_dir`).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import _format
from ..storage import join
from ..errors import CorruptCheckpointError
from ..storage.fsio import BlockCrc, byte_view, close_file, file_size, open_in_dir, preadv_all

#: Largest bounce-buffer memory of one read run (bytes).
BOUNCE_BYTES = 64 << 20
#: Bytes per ``preadv`` of a checksummed run (rounded to whole CRC blocks); CRC32s overlap the next read.
WINDOW_BYTES = 16 << 20


@dataclass
class _Segment:
    offset: int          # absolute file offset (bytes)
    nbytes: int
    dest: torch.Tensor   # 1-D destination, numel == nbytes / src itemsize
    src_dtype: torch.dtype
    what: str            # tensor name, for error messages

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def direct(self) -> bool:
        d = self.dest
        return d.device.type == "cpu" and d.is_contiguous() and d.dtype == self.src_dtype


class _File:
    def __init__(self, fd: int, size: int, header: _format.Header, record: dict | None, where: str):
        self.fd, self.size, self.header, self.record, self.where = fd, size, header, record, where
        self.segments: list[_Segment] = []


class ReadPlan:
    """Validated files of one directory and the reads queued against them (see module docstring)."""

    def __init__(self, directory: str, records: dict[str, dict] | None = None, allowed_roots: tuple[str, ...] = (),
                 threads: int = 4):
        self.directory = directory
        self.records = records
        self.allowed_roots = allowed_roots
        self.threads = threads
        self._files: dict[str, _File] = {}
        self.bytes_read = 0
        #: ``progress(done_bytes, total_bytes)`` during :meth:`execute` (payload bytes), when set
        self.progress = None
        self._done, self._done_lock = 0, threading.Lock()  # files are read by several threads

    def header(self, name: str) -> _format.Header:
        """Open, size-check and parse file ``name`` once; return its validated header."""
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self._open(name)
        return f.header

    def _open(self, name: str) -> _File:
        where = join(self.directory, name)
        record = None
        if self.records is not None:
            record = self.records.get(name)
            if record is None:
                raise CorruptCheckpointError(f"{where}: not listed in manifest.json")
        fd = open_in_dir(self.directory, name, where, self.allowed_roots)
        try:
            size = file_size(fd)
            if record is not None and size != record["bytes"]:
                raise CorruptCheckpointError(
                    f"{where} is {size:,} bytes; manifest.json says {record['bytes']:,}: the file is "
                    f"{'truncated' if size < record['bytes'] else 'extended'}. Copy the checkpoint again, "
                    "or load the previous one.")
            header = self._parse_header(fd, size, where)
            if record is not None and header.data_start != record["data_start"]:
                raise CorruptCheckpointError(f"{where}: data starts at byte {header.data_start}, "
                                             f"manifest.json says {record['data_start']}")
        except BaseException:
            close_file(fd)
            raise
        return _File(fd, size, header, record, where)

    def _parse_header(self, fd: int, size: int, where: str) -> _format.Header:
        """The file's safetensors header (a subclass reading raw files returns an empty one)."""
        return _format.read_header(fd, size, where)

    def fd(self, name: str) -> tuple[int, str]:
        """``(fd, path)`` of validated file ``name`` (opened by :meth:`header`)."""
        self.header(name)
        f = self._files[name]
        return f.fd, f.where

    def add(self, name: str, offset: int, src_dtype: torch.dtype, dest: torch.Tensor, what: str) -> None:
        """Queue: read ``dest.numel()`` elements of ``src_dtype`` at byte ``offset`` of ``name`` into ``dest``."""
        assert dest.dim() == 1
        nbytes = dest.numel() * src_dtype.itemsize
        if nbytes:
            f = self._files[name]
            assert f.header.data_start <= offset and offset + nbytes <= f.size
            f.segments.append(_Segment(offset, nbytes, dest, src_dtype, what))

    def execute(self) -> None:
        """Perform every queued read (files in parallel threads); raise on the first failure."""
        files = [f for f in self._files.values() if f.segments]
        self._total, self._done = sum(s.nbytes for f in files for s in f.segments), 0
        if self.progress is not None:
            self.progress(0, self._total)
        if len(files) <= 1 or self.threads <= 1:
            for f in files:
                self._read_file(f)
        else:
            with ThreadPoolExecutor(min(self.threads, len(files))) as pool:
                for fut in [pool.submit(self._read_file, f) for f in files]:
                    fut.result()

    def close(self) -> None:
        for f in self._files.values():
            close_file(f.fd)
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- execution -------------------------------------------------------------------------------------
    def _read_file(self, f: _File) -> None:
        segs = sorted(f.segments, key=lambda s: s.offset)
        f.segments = []
        needed = sum(s.nbytes for s in segs)
        if needed * 2 < f.size and hasattr(os, "posix_fadvise") and isinstance(f.fd, int):
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_RANDOM)
        for run in self._runs(f, segs):
            self._read_run(f, run)

    def _bounds(self, f: _File, seg: _Segment) -> tuple[int, int]:
        """Byte extent a read of ``seg`` must cover: widened to CRC block boundaries when checksummed."""
        if f.record is None:
            return seg.offset, seg.end
        b = f.record["block_bytes"]
        return seg.offset // b * b, min(-(-seg.end // b) * b, f.size)

    def _runs(self, f: _File, segs: list[_Segment]):
        run, run_end, bounce = [], -1, 0
        for s in segs:
            lo, hi = self._bounds(f, s)
            cost = 0 if s.direct else s.nbytes
            contiguous = run and s.offset >= run[-1].end and lo <= run_end
            if run and (not contiguous or bounce + cost > BOUNCE_BYTES):
                yield run
                run, bounce = [], 0
            run.append(s)
            run_end = max(run_end, hi) if len(run) > 1 else hi
            bounce += cost
        if run:
            yield run

    def _read_run(self, f: _File, run: list[_Segment]) -> None:
        start = self._bounds(f, run[0])[0]
        end = max(self._bounds(f, s)[1] for s in run)
        bufs, posts = _iovecs(run, start, end)
        if f.record is None:
            preadv_all(f.fd, bufs, start, f.where)
        else:
            self._read_verified(f, bufs, start, run)
        self.bytes_read += end - start
        for dest, bounce in posts:
            dest.copy_(bounce)
        if self.progress is not None:
            with self._done_lock:
                self._done += sum(s.nbytes for s in run)
                self.progress(self._done, self._total)

    def _read_verified(self, f: _File, bufs: list[memoryview], start: int, run: list[_Segment]) -> None:
        """Read ``bufs`` (starting at block-aligned ``start``) and check every block's CRC32.

        A long run is read in windows of whole blocks; each window's CRC32s are computed on a helper thread
        while the next window is read (``preadv`` and the CRC32 both release the GIL), so the checksum
        overlaps the disk instead of following it (it costs as much CPU as the read itself).
        """
        b = f.record["block_bytes"]
        windows = _windows(bufs, start, max(1, WINDOW_BYTES // b) * b)
        if len(windows) == 1:
            preadv_all(f.fd, bufs, start, f.where)
            self._check(f, _block_crcs(bufs, b), start, run)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="fsdp_plugin-crc") as crc_pool:
            pending = []
            for offset, views in windows:
                preadv_all(f.fd, views, offset, f.where)
                pending.append((offset, crc_pool.submit(_block_crcs, views, b)))
            for offset, fut in pending:
                self._check(f, fut.result(), offset, run)

    def _check(self, f: _File, crcs: list[int], start: int, run: list[_Segment]) -> None:
        """Compare the CRC32s of consecutive blocks from block-aligned byte ``start`` with the manifest's."""
        b = f.record["block_bytes"]
        first = start // b
        expected = f.record["crc32"]
        for i, got in enumerate(crcs):
            k = first + i
            if k >= len(expected) or expected[k] != got:
                lo, hi = k * b, min((k + 1) * b, f.size)
                names = sorted({s.what for s in run if s.offset < hi and s.end > lo})
                raise CorruptCheckpointError(
                    f"{f.where}: block {k} (bytes {lo:,}-{hi:,}) fails its CRC32 check: the file is corrupted "
                    f"(tensors {', '.join(names[:5]) or '(header)'}). Load the previous checkpoint.")


def _iovecs(run: list[_Segment], start: int, end: int) -> tuple[list[memoryview], list]:
    """Buffers covering bytes ``[start, end)`` in order (destinations, bounce buffers, scratch for gaps) and
    the ``(dest, bounce)`` copies to make after the read."""
    bufs, posts, pos = [], [], start
    for s in run:
        if s.offset > pos:
            bufs.append(memoryview(bytearray(s.offset - pos)))
        if s.direct:
            bufs.append(byte_view(s.dest))
        else:
            bounce = torch.empty(s.dest.numel(), dtype=s.src_dtype)
            bufs.append(byte_view(bounce))
            posts.append((s.dest, bounce))
        pos = s.end
    if end > pos:
        bufs.append(memoryview(bytearray(end - pos)))
    return bufs, posts


def _windows(bufs: list[memoryview], start: int, step: int) -> list[tuple[int, list[memoryview]]]:
    """``bufs`` (covering bytes from ``start``) cut at ``start + k * step``: ``[(offset, views), ...]``."""
    out, cur, pos, limit = [], [], start, start + step
    for buf in bufs:
        while len(buf):
            take = min(len(buf), limit - pos)
            cur.append(buf[:take])
            buf, pos = buf[take:], pos + take
            if pos == limit:
                out.append((limit - step, cur))
                cur, limit = [], limit + step
    if cur:
        out.append((limit - step, cur))
    return out


def _block_crcs(views: list[memoryview], block_bytes: int) -> list[int]:
    crc = BlockCrc(block_bytes)
    for v in views:
        crc.update(v)
    return crc.finish()
