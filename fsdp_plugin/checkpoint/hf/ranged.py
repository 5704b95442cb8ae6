"""Write safetensors files planned elsewhere (names, dtypes, shapes, metadata: e.g. captured from a library's own
``save_pretrained``) from a sharded model, every rank its own byte ranges. Collective.

A plan is one JSON-able list per file: ``[path, metadata, [[name, dtype, shape, runs], ...]]``; each run
``[out, source, start, n]`` says that elements ``[out, out + n)`` of output tensor ``name`` are elements
``[start, start + n)`` of the flattened model tensor ``source`` (a ``state_dict`` key: parameter, tied alias or
persistent buffer); the runs of a tensor cover it exactly. Rank 0 creates each file at its final size under
a temporary name with its header (:mod:`.st_header`: the safetensors library's own layout), every rank
``pwrite``\\ s the overlap of its shard pieces (buffers: rank 0), rank 0 fsyncs and renames the files into place.
Memory: no tensor is assembled; a rank's bytes go from its shard to the file (from an accelerator, through the
host in chunks of ``_CHUNK`` elements). Without a shared filesystem the pieces go to rank 0 point-to-point,
one at a time.
"""
from __future__ import annotations

import json
import os

import torch

from .. import _comm, _model
from ..format import _format, st_header
from ..errors import CheckpointError
from ..storage.fsio import byte_view, fsync_path, write_all
from .hf_gather import entry_runs, piece_table
from ..format.boxes import overlaps
from ..format.writer import flat_cpu

#: Elements copied to the host at a time from an accelerator shard (a view, no copy, on CPU).
_CHUNK = 1 << 22


def write_planned(model, plan: list | None, uid: str) -> None:
    """Collective: write the files of ``plan`` (given on rank 0, None elsewhere); ``uid`` names temporaries.

    Deadlines and error names: the caller's (:func:`._comm.deadline_of`)."""
    rank = _comm.rank()
    plan = json.loads(_comm.broadcast_bytes(json.dumps(plan).encode() if rank == 0 else None,
                                            step="broadcasting the export plan"))
    files = [_File(path, metadata, entries, uid) for path, metadata, entries in plan]
    err = attempt(lambda: [f.create() for f in files]) if rank == 0 else None
    _comm.raise_if_any_failed(err, "creating the export files")
    shared = _comm.all_true(_sees(files), "checking the files are shared")
    err = attempt(lambda: _Sources(model).write(files, shared))
    for f in files:
        f.close()
    try:
        _comm.raise_if_any_failed(err, "writing the export files")
    except BaseException:
        if rank == 0:
            for f in files:
                f.remove()
        raise
    err = attempt(lambda: [f.publish() for f in files]) if rank == 0 else None
    _comm.raise_if_any_failed(err, "publishing the export files")


def _sees(files: list) -> bool:
    """Whether this rank sees the files rank 0 created (a shared filesystem)."""
    return all(os.path.exists(f.tmp) for f in files)


def fill_existing(model, path: str | None, entries: list | None) -> None:
    """Collective: write each rank's bytes into file ``path`` that rank 0 laid out already (e.g. a
    ``torch.save`` archive with empty storage records). ``path`` and ``entries``
    (``[[name, dtype, shape, runs, absolute byte offset], ...]``) are given on rank 0, None elsewhere."""
    rank = _comm.rank()
    path, entries = json.loads(_comm.broadcast_bytes(json.dumps([path, entries]).encode() if rank == 0 else None,
                                                     step="broadcasting the export plan"))
    target = _Existing(path, entries)
    shared = _comm.all_true(_sees([target]), "checking the file is shared")
    err = attempt(lambda: _Sources(model).write([target], shared))
    target.close()
    _comm.raise_if_any_failed(err, "writing the export file")


class _File:
    """One planned safetensors file: header, where each tensor's bytes go, and the temporary it is built in."""

    def __init__(self, path: str, metadata, entries: list, uid: str):
        self.path, self.tmp = path, f"{path}.tmp-{uid}"
        self.entries = [(n, dt, tuple(shape), runs) for n, dt, shape, runs in entries]
        self.header, self.offset, self.size = st_header.encode([e[:3] for e in self.entries], metadata)
        self._fd: int | None = None

    def create(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, memoryview(self.header))
            os.ftruncate(fd, self.size)
        finally:
            os.close(fd)

    def pwrite(self, name: str, dtype: str, elem: int, data: memoryview) -> None:
        """``data`` at element ``elem`` of output tensor ``name``."""
        if self._fd is None:
            self._fd = os.open(self.tmp, os.O_WRONLY)
        pos = self.offset[name] + elem * _format.itemsize(dtype)
        while len(data):
            n = os.pwrite(self._fd, data[: 1 << 30], pos)
            data, pos = data[n:], pos + n

    def close(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def publish(self) -> None:
        fsync_path(self.tmp)
        os.replace(self.tmp, self.path)
        fsync_path(os.path.dirname(self.path) or ".", directory=True)

    def remove(self) -> None:
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass


class _Existing(_File):
    """A file laid out by someone else: the byte offset of every entry is given."""

    def __init__(self, path: str, entries: list):
        self.path = self.tmp = path
        self.entries = [(n, dt, tuple(shape), runs) for n, dt, shape, runs, _ in entries]
        self.offset = {e[0]: int(e[4]) for e in entries}
        self._fd = None


class _Sources:
    """Where a ``state_dict`` key's elements live on this rank: a parameter piece ``[start, end)`` or a buffer."""

    def __init__(self, model):
        self.shards = _model.param_shards(model, boxes=True)
        self.runs = [_model.piece_runs(sh) for sh in self.shards]   # a TP box: one run per row it cuts
        self.index = {n: i for i, sh in enumerate(self.shards) for n in (sh.fqn, *sh.aliases)}
        self.buffers = dict(_model.persistent_buffers(model))
        self.table = None

    def write(self, files: list[_File], shared: bool) -> None:
        """Every planned tensor, in plan order (the same on every rank: the point-to-point schedule)."""
        if not shared:
            self.table = piece_table(self.shards)
        for f in files:
            for name, dt, _shape, runs in f.entries:
                for out, src, start, n in runs:
                    self._one(f, name, dt, int(out), src, int(start), int(n), shared)

    def _one(self, f: _File, name, dt, out: int, src: str, start: int, n: int, shared: bool) -> None:
        """Elements ``[start, start + n)`` of ``src`` to elements ``[out, out + n)`` of output ``name``."""
        if src in self.buffers:
            if _comm.rank() == 0:
                flat = flat_cpu(self.buffers[src])[start:start + n]
                f.pwrite(name, dt, out, byte_view(_checked(flat, dt, name)))
            return
        if src not in self.index:
            raise CheckpointError(f"export plan: {name!r} comes from {src!r}, which the model does not have")
        i = self.index[src]
        sh = self.shards[i]
        _checked(sh.param, dt, name)
        if shared:
            for so, do, k in (overlaps(self.runs[i], [(start, n)]) if sh.writer else ()):
                for a in range(0, k, _CHUNK):  # off-host shards pass through the host one chunk at a time
                    b = min(a + _CHUNK, k)
                    f.pwrite(name, dt, out + do + a, byte_view(_piece(sh.param, so + a, so + b)))
        else:
            self._via_rank0(f, name, dt, out, i, start, n)

    def _via_rank0(self, f: _File, name, dt, out: int, i: int, start: int, n: int) -> None:
        """No shared filesystem: each writer rank's overlap goes to rank 0 (one message: its runs' parts in
        order), which writes it."""
        sh, rank = self.shards[i], _comm.rank()
        if rank != 0:
            parts = list(overlaps(self.runs[i], [(start, n)])) if sh.writer else []
            if parts:
                flat = sh.param.detach().reshape(-1)
                piece = torch.cat([flat[so:so + k] for so, _, k in parts])
                _comm.send(piece.to(_comm._device()).contiguous(), 0, f"sending {name!r} to rank 0")
            return
        for r, rng in enumerate(row[i] for row in self.table):
            parts = list(overlaps(entry_runs(rng, sh.shape), [(start, n)])) if rng else []
            if not parts:
                continue
            if r == 0:
                piece = flat_cpu(torch.cat([sh.param.detach().reshape(-1)[so:so + k] for so, _, k in parts]))
            else:
                piece = torch.empty(sum(k for *_, k in parts), dtype=sh.dtype, device=_comm._device())
                _comm.recv(piece, r, f"receiving {name!r} from rank {r}")
                piece = flat_cpu(piece)
            pos = 0
            for _, do, k in parts:
                f.pwrite(name, dt, out + do, byte_view(piece[pos:pos + k]))
                pos += k


def _piece(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return flat_cpu(t.detach().reshape(-1)[lo:hi])


def _checked(t: torch.Tensor, dt: str, name: str) -> torch.Tensor:
    if _format.dtype_name(t.dtype) != dt:
        raise CheckpointError(f"export plan: {name!r} is planned as {dt} but the model holds "
                              f"{_format.dtype_name(t.dtype)}; plan the model's own dtype")
    return t


def attempt(fn) -> BaseException | None:
    """``fn()``'s exception, returned (not raised): the caller shares it so that every rank raises together."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every rank raises together
        return e
    return None
