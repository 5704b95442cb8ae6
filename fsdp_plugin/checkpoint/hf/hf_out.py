"""Writing Hugging Face safetensors files (+ ``model.safetensors.index.json``) piece by piece.

The plan is computed from names, dtypes and shapes alone (HF greedy split in the given order, decimal
``max_shard_size``), so every tensor's absolute byte offset is known before any data exists. Files are
created at full size under temporary names (``<name>.tmp-<uid>``), filled with ``pwrite`` at those
offsets by whoever holds the bytes (any rank, any order), fsynced, then renamed into place; the index is
written last. Memory is O(1): nothing is assembled in RAM.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..._sizes import parse_size
from ..format import _format
from ..storage.fsio import fsync_path, write_all

INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
@dataclass(frozen=True)
class Placement:
    """Where a tensor goes: output file index and absolute byte offset of its first element."""

    file: int
    offset: int
    dtype: str
    shape: tuple


class HFWriter:
    """Plan, create, fill (``pwrite``) and publish HF safetensors files in ``out_dir``."""

    def __init__(self, out_dir: str, entries: list[tuple[str, str, tuple]], max_shard_size, uid: str):
        self.out_dir, self.uid = out_dir, uid
        groups = _split(entries, parse_size(max_shard_size))
        n = len(groups)
        self.names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                           for i in range(n)]
        self.headers, self.sizes, self.place = [], [], {}
        for i, group in enumerate(groups):
            header, offsets = _format.encode_header(group, {"format": "pt"}, align=8)
            self.headers.append(header)
            self.sizes.append(offsets[-1] + _nbytes(group[-1]) if group else len(header))
            for (name, dt, shape), off in zip(group, offsets):
                self.place[name] = Placement(i, off, dt, tuple(shape))
        self.total_size = sum(_nbytes(e) for e in entries)
        self._fds: dict[int, int] = {}

    def tmp_path(self, i: int) -> str:
        return os.path.join(self.out_dir, f"{self.names[i]}.tmp-{self.uid}")

    def create(self) -> None:
        """Create every output file at its final size with its header (one process does this)."""
        os.makedirs(self.out_dir, exist_ok=True)
        for i, header in enumerate(self.headers):
            fd = os.open(self.tmp_path(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, memoryview(header))
                os.ftruncate(fd, self.sizes[i])
            finally:
                os.close(fd)

    def pwrite(self, name: str, elem_start: int, data: memoryview) -> None:
        """Write ``data`` (bytes of the stored dtype) at element ``elem_start`` of tensor ``name``."""
        p = self.place[name]
        fd = self._fds.get(p.file)
        if fd is None:
            fd = self._fds[p.file] = os.open(self.tmp_path(p.file), os.O_WRONLY)
        pos = p.offset + elem_start * _format.itemsize(p.dtype)
        while len(data):
            n = os.pwrite(fd, data[: 1 << 30], pos)
            data, pos = data[n:], pos + n

    def sync_close(self) -> None:
        """fsync and close every file this process wrote to."""
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()

    def publish(self) -> None:
        """fsync all files, rename them into place, drop stale shards of an earlier save, write the index."""
        for i in range(len(self.names)):
            fsync_path(self.tmp_path(i))
        for i, name in enumerate(self.names):
            os.replace(self.tmp_path(i), os.path.join(self.out_dir, name))
        keep = set(self.names)
        for name in os.listdir(self.out_dir):
            if (_SHARD_RE.match(name) or name == INDEX_NAME) and name not in keep:
                os.remove(os.path.join(self.out_dir, name))
        if len(self.names) > 1:
            self._write_index()
        fsync_path(self.out_dir, directory=True)

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for i in range(len(self.names)):
            try:
                os.remove(self.tmp_path(i))
            except FileNotFoundError:
                pass

    def _write_index(self) -> None:
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": {n: self.names[p.file] for n, p in sorted(self.place.items())}}
        tmp = os.path.join(self.out_dir, f"{INDEX_NAME}.tmp-{self.uid}")
        with open(tmp, "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.out_dir, INDEX_NAME))


def _nbytes(entry) -> int:
    return _format.numel(entry[2]) * _format.itemsize(entry[1])


def _split(entries, limit: int) -> list[list]:
    """HF greedy split: a new file when the next tensor would overflow ``limit`` (bytes)."""
    groups, cur, size = [], [], 0
    for e in entries:
        nb = _nbytes(e)
        if cur and size + nb > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += nb
    if cur or not groups:
        groups.append(cur)
    return groups
