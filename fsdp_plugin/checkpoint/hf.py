"""Hugging Face safetensors interop for sharded models.

* :func:`load_pretrained` reads ``model.safetensors`` or the shards listed by
  ``model.safetensors.index.json``: every rank reads only the byte range of each tensor that its local
  piece covers (one contiguous range per tensor, cast through a bounded bounce buffer when the dtypes
  differ), straight into the local shard. No mmap, no full copy, no pickle.
* :func:`save_pretrained` writes HF safetensors + index without any gather: rank 0 creates the files
  at their final size, every rank ``pwrite``\\ s its own pieces at precomputed offsets, rank 0 publishes
  (fsync, rename, index last). The output directory must be visible to all ranks (shared filesystem).
"""
from __future__ import annotations

import os
import uuid

import torch

from . import _comm, _format, _model
from .errors import CheckpointError, CheckpointMismatchError, MismatchReport
from .fsio import byte_view, check_plain_name, open_in_dir
from .hf_gather import gather_write
from .hf_out import INDEX_NAME, HFWriter
from .reader import ReadPlan
from .writer import flat_cpu

#: Largest index file we read (bytes).
MAX_INDEX_BYTES = 64 << 20
#: Elements cast at a time when saving in another dtype.
_CAST_CHUNK = 1 << 22


@_comm.uses_model_deadline
def load_pretrained(model, path, strict: bool = True) -> MismatchReport:
    """Load HF safetensors weights from ``path`` (a directory or one ``.safetensors`` file) into ``model``.

    Collective. Names are matched by FQN (tied aliases included); dtypes are cast. ``strict=True`` raises
    :class:`CheckpointMismatchError` before reading if names or shapes differ; otherwise the intersection
    is loaded and the returned :class:`MismatchReport` says what was skipped.
    """
    err, report = None, MismatchReport()
    try:
        _load_local(model, os.fspath(path), strict, report)
    except Exception as e:  # noqa: BLE001 - every rank raises together
        err = e
    _comm.raise_if_any_failed(err)
    return report


def _load_local(model, path: str, strict: bool, report: MismatchReport) -> None:
    directory, files = _resolve(path)
    with ReadPlan(directory, None, allowed_roots=_allowed_roots(directory)) as plan:
        stored = {}
        for f in files:
            for name, e in plan.header(f).entries.items():
                stored[name] = (f, e)
        reads = _match(model, stored, report)
        if report and strict:
            raise CheckpointMismatchError(f"{path} does not match the model: {report.describe()} "
                                          "(pass strict=False to load the intersection)", report)
        copy_back = []
        for target, f, e, start in reads:
            dest, tmp = _model.flat_dest(target)
            if tmp is not None:
                copy_back.append((target.detach(), tmp))
            src = _format.to_dtype(e.dtype)
            plan.add(f, e.begin + start * src.itemsize, src, dest, e.name)
        plan.execute()
    for dst, src in copy_back:
        dst.copy_(src)


def _match(model, stored: dict, report: MismatchReport) -> list:
    reads, known = [], set()
    for sh in _model.param_shards(model):
        names = (sh.fqn, *sh.aliases)
        known.update(names)
        hit = next((n for n in names if n in stored), None)
        if hit is None:
            report.missing.append(sh.fqn)
        elif tuple(stored[hit][1].shape) != tuple(sh.shape):
            report.mismatched[sh.fqn] = f"file {list(stored[hit][1].shape)} vs model {list(sh.shape)}"
        else:
            reads.append((sh.param, *stored[hit], sh.start))
    for name, buf in _model.persistent_buffers(model):
        known.add(name)
        if name not in stored:
            report.missing.append(name)
        elif tuple(stored[name][1].shape) != tuple(buf.shape):
            report.mismatched[name] = f"file {list(stored[name][1].shape)} vs model {list(buf.shape)}"
        else:
            reads.append((buf, *stored[name], 0))
    report.unexpected += sorted(n for n in stored if n not in known)
    return reads


def _resolve(path: str) -> tuple[str, list[str]]:
    """(directory, safetensors file names) of an HF checkpoint at ``path``."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.lexists(os.path.join(path, INDEX_NAME)):
        return path, _read_index(path)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path, ["model.safetensors"]
    raise CheckpointError(f"{path} has neither model.safetensors nor {INDEX_NAME}")


def _read_index(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX_NAME)
    fd = open_in_dir(directory, INDEX_NAME, index, _allowed_roots(directory))
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{index}: larger than {MAX_INDEX_BYTES} bytes; refusing to read it")
        doc = _format.strict_json_loads(os.pread(fd, size, 0), index)
    finally:
        os.close(fd)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{index}: no valid weight_map")
    files = sorted(set(wm.values()))
    for f in files:
        check_plain_name(f, index)
        if not f.endswith(".safetensors"):
            raise CheckpointError(f"{index}: {f!r} is not a .safetensors file")
    return files


def _allowed_roots(directory: str) -> tuple[str, ...]:
    """The directory itself, plus ``<repo>/blobs`` for a Hugging Face cache ``<repo>/snapshots/<rev>``."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return tuple(roots)


# -- save ----------------------------------------------------------------------------------------------------
@_comm.uses_model_deadline
def save_pretrained(model, path, max_shard_size="5GB", dtype: torch.dtype | None = None,
                    gather: bool | None = None) -> None:
    """Write ``model`` as HF safetensors (+ index when split) into directory ``path``. Collective.

    Tied parameters are written once, under their first name. ``dtype`` casts floating tensors (in
    chunks of ``_CAST_CHUNK`` elements). By default every rank writes its own pieces (no gather, O(chunk)
    memory); when some rank cannot see the files rank 0 created (no shared filesystem), or with
    ``gather=True``, pieces are sent to rank 0 one parameter at a time instead (:mod:`.hf_gather`).
    """
    path = os.path.abspath(os.fspath(path))
    rank = _comm.rank()
    shards = _model.param_shards(model)
    buffers = _model.persistent_buffers(model)
    entries = _entries(shards, buffers, dtype)
    uid = _comm.broadcast_bytes(uuid.uuid4().hex.encode() if rank == 0 else None).decode()
    writer = HFWriter(path, entries, max_shard_size, uid)
    err = None
    if rank == 0:
        err = _attempt(writer.create)
    _comm.raise_if_any_failed(err)
    if gather is None:
        gather = not _comm.all_true(os.path.exists(writer.tmp_path(0)))
    if gather:
        err = _attempt(lambda: _gather_pieces(writer, shards, buffers, dtype))
    else:
        err = _attempt(lambda: _write_pieces(writer, shards, buffers if rank == 0 else [], dtype))
    try:
        _comm.raise_if_any_failed(err)
    except BaseException:
        if rank == 0:
            writer.abort()
        raise
    if rank == 0:
        err = _attempt(writer.publish)
    _comm.raise_if_any_failed(err)


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _out_dtype(t_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype


def _entries(shards, buffers, dtype) -> list[tuple[str, str, tuple]]:
    out = [(sh.fqn, _format.dtype_name(_out_dtype(sh.dtype, dtype)), tuple(sh.shape)) for sh in shards]
    out += [(n, _format.dtype_name(_out_dtype(b.dtype, dtype)), tuple(b.shape)) for n, b in buffers]
    return out


def _write_pieces(writer: HFWriter, shards, buffers, dtype) -> None:
    try:
        for sh in shards:
            if sh.writer and sh.end > sh.start:
                _write_tensor(writer, sh.fqn, sh.param, sh.start, dtype)
        for name, buf in buffers:
            _write_tensor(writer, name, buf, 0, dtype)
    finally:
        writer.sync_close()


def _gather_pieces(writer: HFWriter, shards, buffers, dtype) -> None:
    try:
        gather_write(writer, shards, buffers, lambda name, t, start: _write_tensor(writer, name, t, start, dtype))
    finally:
        writer.sync_close()


def _write_tensor(writer: HFWriter, name: str, t: torch.Tensor, start: int, dtype) -> None:
    flat = t.detach().reshape(-1)
    out = _out_dtype(flat.dtype, dtype)
    if out == flat.dtype:
        flat = flat_cpu(flat)
        writer.pwrite(name, start, byte_view(flat))
        return
    for i in range(0, flat.numel(), _CAST_CHUNK):
        chunk = flat[i:i + _CAST_CHUNK].to("cpu", out).contiguous()
        writer.pwrite(name, start + i, byte_view(chunk))

