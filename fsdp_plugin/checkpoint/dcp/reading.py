"""Ranged reads of DCP tensors: a local flat piece ``[start, end)`` of a tensor, from whatever chunks hold it.

A chunk is an N-D box of the global tensor. Let ``k`` be the lowest dimension after which every dimension
is full: the box is then ``prod(sizes[:k])`` runs of ``sizes[k] * prod(size[k+1:])`` elements, each
contiguous both in the chunk and in the row-major flattened global tensor (an FSDP ``Shard(0)`` chunk is
one run). Intersecting the runs with ``[start, end)`` gives exact byte ranges of the data files, read by
:class:`~fsdp_plugin.checkpoint.format.reader.ReadPlan` straight into the destination (cast through its bounce
buffer when dtypes differ). DCP guarantees no coverage, so the covered elements are counted. A chunk read
whole straight into CPU memory (a rank's piece covering a saved chunk: world 1, small tensors, a matching
layout) is checked against its zip CRC-32; a partial read cannot be (the CRC covers the whole record).
DCP's own reader checks none.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..format import _format, boxes
from ..errors import CorruptCheckpointError
from ..storage import join
from ..storage.fsio import byte_view, crc32, file_size
from ..format.reader import ReadPlan
from . import items
from .metadata import BytesEntry, Chunk, TensorEntry


class _RawPlan(ReadPlan):
    """A :class:`ReadPlan` over files without a safetensors header (DCP's ``.distcp``): data starts at 0."""

    def _parse_header(self, fd: int, size: int, where: str) -> _format.Header:
        return _format.Header({}, {}, 0)


def runs(chunk: Chunk, size: tuple):
    """``(global_start, chunk_start, length)`` of every contiguous run of ``chunk``, in increasing order."""
    nd = len(size)
    if nd == 0:
        yield 0, 0, 1
        return
    if 0 in chunk.sizes:
        return
    k = nd - 1
    while k > 0 and chunk.sizes[k] == size[k]:
        k -= 1
    gstride = [math.prod(size[j + 1:]) for j in range(nd)]
    run = chunk.sizes[k] * gstride[k]
    base = chunk.offsets[k] * gstride[k]
    for n, idx in enumerate(itertools.product(*(range(o, o + s) for o, s in zip(chunk.offsets[:k], chunk.sizes[:k])))):
        yield base + sum(i * g for i, g in zip(idx, gstride)), n * run, run


def _check_crc(dest: torch.Tensor, h: items.TensorHeader, entry: TensorEntry, chunk: Chunk, what: str) -> None:
    if crc32(byte_view(dest)) != h.crc32:
        where = join(entry.directory, chunk.file)
        raise CorruptCheckpointError(
            f"{where}: bytes {h.data_offset:,}-{h.data_offset + dest.numel() * h.dtype.itemsize:,} ({what}, chunk at "
            f"{list(chunk.offsets)}) fail their CRC-32 check: the file is corrupted. Copy the checkpoint again, "
            "or load the previous one.")


class DcpReader:
    """Queues reads against the data files of one or more DCP directories, then performs them."""

    def __init__(self):
        self._plans: dict[str, _RawPlan] = {}
        self._headers: dict[tuple, items.TensorHeader] = {}
        self._posts: list = []
        self.bytes_needed = 0

    def _plan(self, directory: str) -> _RawPlan:
        plan = self._plans.get(directory)
        if plan is None:
            plan = self._plans[directory] = _RawPlan(directory, None)
        return plan

    def _fd(self, directory: str, name: str, offset: int, length: int) -> tuple[int, str]:
        """The open data file, checked to hold bytes ``[offset, offset + length)`` (else truncated)."""
        plan = self._plan(directory)
        fd, where = plan.fd(name)
        size = file_size(fd)
        if offset + length > size:
            raise CorruptCheckpointError(
                f"{where} is {size:,} bytes; .metadata places an item at bytes {offset:,}-{offset + length:,}: the "
                "file is truncated. Copy the checkpoint again, or load the previous one.")
        return fd, where

    def header(self, entry: TensorEntry, chunk: Chunk, what: str) -> items.TensorHeader:
        key = (entry.directory, chunk.file, chunk.offset)
        h = self._headers.get(key)
        if h is None:
            fd, where = self._fd(entry.directory, chunk.file, chunk.offset, chunk.length)
            h = items.tensor_header(fd, chunk.offset, chunk.length, f"{where} ({what} at byte {chunk.offset:,})")
            if h.dtype != entry.dtype or h.size != chunk.sizes:
                raise CorruptCheckpointError(f"{where}: {what} chunk is {h.dtype} {list(h.size)}; .metadata says "
                                             f"{entry.dtype} {list(chunk.sizes)}")
            if h.data_offset + h.storage_numel * h.dtype.itemsize > chunk.offset + chunk.length:
                raise CorruptCheckpointError(f"{where}: {what} chunk data overruns its item")
            self._headers[key] = h
        return h

    def queue(self, entry: TensorEntry, start: int, dest: torch.Tensor, what: str) -> None:
        """Queue: elements ``[start, start + dest.numel())`` of the flattened tensor into 1-D ``dest``."""
        self.queue_runs(entry, [(start, dest.numel())], dest, what)

    def queue_runs(self, entry: TensorEntry, want: list, dest: torch.Tensor, what: str) -> None:
        """Queue: the elements of runs ``want`` (``(global_start, n)``, ascending: a tensor-parallel box of the
        flattened tensor) into 1-D ``dest``, stored one run after the other."""
        covered = 0
        for chunk in entry.chunks:
            have = [(g, n) for g, _, n in runs(chunk, entry.size)]
            for so, do, n in boxes.overlaps(have, want):
                self._queue_run(entry, chunk, so, dest[do:do + n], what)
                covered += n
        if covered != dest.numel():
            first = want[0][0] if want else 0
            raise CorruptCheckpointError(
                f"{entry.directory}: the chunks of {what} cover {covered:,} of the {dest.numel():,} elements "
                f"(from {first:,}) this rank needs: the checkpoint is incomplete or its .metadata is damaged")

    def _queue_run(self, entry, chunk, c: int, dest: torch.Tensor, what: str) -> None:
        h = self.header(entry, chunk, what)
        plan = self._plan(entry.directory)
        self.bytes_needed += dest.numel() * h.dtype.itemsize
        if h.contiguous:
            plan.add(chunk.file, h.data_offset + c * h.dtype.itemsize, h.dtype, dest, what)
            if c == 0 and dest.numel() == h.storage_numel and dest.device.type == "cpu" and dest.dtype == h.dtype:
                self._posts.append(lambda: _check_crc(dest, h, entry, chunk, what))
            return
        # a strided chunk (e.g. a saved transpose): read its storage whole, then copy the run out
        storage = torch.empty(h.storage_numel, dtype=h.dtype)
        plan.add(chunk.file, h.data_offset, h.dtype, storage, what)
        self._posts.append(lambda: dest.copy_(
            storage.as_strided(h.size, h.stride, h.storage_offset).reshape(-1)[c:c + dest.numel()]))

    def whole(self, entry: TensorEntry, what: str) -> torch.Tensor:
        """Queue the whole tensor into a new CPU tensor (filled by :meth:`execute`)."""
        t = torch.empty(entry.size, dtype=entry.dtype)
        self.queue(entry, 0, t.view(-1), what)
        return t

    def value(self, entry: BytesEntry, what: str):
        """A non-tensor value, read now (they are small)."""
        fd, where = self._fd(entry.directory, entry.file, entry.offset, entry.length)
        return items.read_value(fd, entry.offset, entry.length, f"{where} ({what})")

    def execute(self) -> None:
        for plan in self._plans.values():
            plan.execute()
        for post in self._posts:
            post()
        self._posts.clear()

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self._plans.values())

    def close(self) -> None:
        for plan in self._plans.values():
            plan.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
