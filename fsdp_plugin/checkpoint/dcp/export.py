"""Write one of our checkpoints as a torch DCP directory (``fsdp-plugin export CKPT OUT --format dcp``).

No process group: rank ``r``'s pieces become ``__{r}_0.distcp``, so the output is as sharded as the input.
A 1-D piece ``[a, b)`` of a row-major shape is cut into at most ``2·(ndim-1)+1`` N-D boxes (a partial
leading row, the full middle rows, a partial trailing row, recursively), each a contiguous slice of the
piece, written as a ``torch.save``-compatible zip item (ZIP_STORED; ``data.pkl`` names only torch's
rebuild function and storage class) streamed through a bounded buffer from the CRC-checked source. The
``.metadata`` is a pickle of DCP's own metadata classes (this is the one module that imports them), with
``planner_data`` so torch's consolidation tools see the nested state dict::

    model.<fqn>                         parameters (tied names share the bytes) and buffers
    optimizer.state.<fqn>.<key>         per-element state sharded like the parameter; ``step`` whole
    optimizer.param_groups.<j>.<hp>     every hyper-parameter and ``params`` (FQN list)
    extra.<path>                        the ``extra`` saved by rank 0

Several optimizers are ``optimizer_0``, ``optimizer_1``, ... (Lightning's names). The directory appears
complete or not at all (written as ``OUT.tmp-<uuid>``, fsynced, renamed); an existing ``OUT`` is refused.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import shutil
import tempfile
import uuid
import zipfile

import torch

from ..format.boxes import is_box
from ..storage import files_dir, is_url, join, resolve, storage_for
from ..format import codec, manifest
from ..errors import CheckpointError
from ..storage.fsio import fsync_path
from ..format.layouts import METADATA_FILE, checkpoint_dir
from ..format.reader import ReadPlan

#: Bytes copied per read/write step of one item (bounds the memory of an export).
BUFFER_BYTES = 64 << 20
_LEGACY = {torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
           torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
           torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
           torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage"}


def boxes(start: int, end: int, shape: tuple):
    """``(offsets, sizes, flat_start)`` of the N-D boxes that tile elements ``[start, end)`` of ``shape``."""
    if start >= end:
        return
    if not shape:
        yield (), (), 0
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(end, inner)
    if r0 == r1:
        for off, sz, fs in boxes(c0, c1, shape[1:]):
            yield (r0, *off), (1, *sz), r0 * inner + fs
        return
    if c0:
        for off, sz, fs in boxes(c0, inner, shape[1:]):
            yield (r0, *off), (1, *sz), r0 * inner + fs
        r0 += 1
    if r1 > r0:
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner
    if c1:
        for off, sz, fs in boxes(0, c1, shape[1:]):
            yield (r1, *off), (1, *sz), r1 * inner + fs


class _Rebuild:
    """Pickles as ``torch._utils._rebuild_tensor_v2/_v3(storage, 0, size, stride, False, OrderedDict()[, dtype])``."""

    def __init__(self, dtype: torch.dtype, size: tuple):
        self.dtype, self.size = dtype, tuple(size)

    def __reduce__(self):
        stride = tuple(math.prod(self.size[i + 1:]) for i in range(len(self.size)))
        args = (_StorageRef(self.dtype, math.prod(self.size)), 0, self.size, stride, False, collections.OrderedDict())
        if self.dtype in _LEGACY:
            return torch._utils._rebuild_tensor_v2, args
        return torch._utils._rebuild_tensor_v3, args + (self.dtype,)


class _StorageRef:
    def __init__(self, dtype: torch.dtype, numel: int):
        self.dtype, self.numel = dtype, numel


class _ItemPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            if obj.dtype in _LEGACY:
                return "storage", getattr(torch, _LEGACY[obj.dtype]), "0", "cpu", obj.numel
            return "storage", torch.storage.UntypedStorage, "0", "cpu", obj.numel * obj.dtype.itemsize
        return None


def _tensor_pickle(dtype: torch.dtype, size: tuple) -> bytes:
    buf = io.BytesIO()
    _ItemPickler(buf, protocol=2).dump(_Rebuild(dtype, size))
    return buf.getvalue()


class _ItemFile(io.RawIOBase):
    """The tail of an open file from ``base`` on, as a file of its own (zip offsets are relative to it)."""

    def __init__(self, f, base: int):
        super().__init__()
        self.f, self.base = f, base

    def writable(self):
        return True

    def seekable(self):
        return True

    def write(self, b):
        return self.f.write(b)

    def tell(self):
        return self.f.tell() - self.base

    def seek(self, pos, whence=0):
        return self.f.seek(pos + self.base if whence == 0 else pos, whence) - self.base

    def flush(self):
        self.f.flush()


def _zinfo(name: str, size: int = 0) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type, zi.file_size = zipfile.ZIP_STORED, size
    return zi


def _write_item(f, pkl: bytes, data=None, nbytes: int = 0) -> tuple[int, int]:
    """Append one ``torch.save`` archive to ``f``; ``data(write)`` streams ``nbytes`` of storage. Returns
    ``(offset, length)`` of the item in the file."""
    base = f.seek(0, os.SEEK_END)
    with zipfile.ZipFile(_ItemFile(f, base), "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(_zinfo("archive/data.pkl"), pkl)
        zf.writestr(_zinfo("archive/byteorder"), b"little")
        if data is not None:
            with zf.open(_zinfo("archive/data/0", nbytes), "w", force_zip64=nbytes >= (1 << 31)) as out:
                data(out.write)
        zf.writestr(_zinfo("archive/version"), b"3\n")
    return base, f.seek(0, os.SEEK_END) - base


class _Job:
    """One tensor item to write: ``nbytes`` of storage from ``src`` (``(file, byte offset)`` of our
    checkpoint, or an in-memory tensor), recorded under ``keys`` (tied names share it)."""

    def __init__(self, keys, dtype, offsets, sizes, nbytes, src):
        self.keys, self.dtype, self.offsets, self.sizes, self.nbytes, self.src = keys, dtype, offsets, sizes, nbytes, src


class _Exporter:
    """Collects items per output rank file and the metadata, then writes them (see module docstring)."""

    def __init__(self, ckpt: str, tmp: str, doc: dict):
        self.ckpt, self.tmp, self.doc = ckpt, tmp, doc
        self.jobs: dict[int, list[_Job]] = {}
        self.values: list[tuple[str, tuple, object]] = []
        self.tensors: dict[str, tuple] = {}      # key -> (dtype, size)
        self.paths: dict[str, tuple] = {}
        self.chunks: dict[str, list] = {}        # key -> [(offsets, sizes, file, offset, length)]
        self.value_storage: dict[str, tuple] = {}

    def stored(self, keys: list[tuple[str, tuple]], entry: dict, kind: str, file_key: str) -> None:
        """A tensor of our checkpoint: every piece of it, as boxes, to the writing rank's output file."""
        from ..format import _format

        dtype, shape = _format.to_dtype(entry["dtype"]), tuple(entry["shape"])
        self._declare(keys, dtype, shape)
        for piece in entry["pieces"]:
            r, fname = piece[0], manifest.file_name(piece[0], kind)
            if is_box(piece):    # a tensor-parallel piece is one DCP chunk as it is
                parts = [(tuple(piece[1]), tuple(piece[2]), 0)]
            else:
                parts = [(off, sz, fs - piece[1]) for off, sz, fs in boxes(piece[1], piece[2], shape)]
            self.jobs.setdefault(r, []).extend(
                _Job([k for k, _ in keys], dtype, off, sz, math.prod(sz) * dtype.itemsize,
                     (fname, file_key, at * dtype.itemsize)) for off, sz, at in parts)

    def memory(self, key: str, path: tuple, t: torch.Tensor) -> None:
        """A whole in-memory tensor (optimizer ``step``, an ``extra`` tensor), written once by rank 0's file."""
        t = t.detach().cpu().contiguous()
        self._declare([(key, path)], t.dtype, tuple(t.shape))
        if t.numel():
            self.jobs.setdefault(0, []).append(_Job([key], t.dtype, (0,) * t.dim(), tuple(t.shape), t.nbytes, t))

    def value(self, key: str, path: tuple, v) -> None:
        if isinstance(v, torch.Tensor):
            self.memory(key, path, v)
        else:
            self.values.append((key, path, v))

    def _declare(self, keys, dtype, shape) -> None:
        for k, path in keys:
            if k in self.tensors or k in self.paths:
                raise CheckpointError(f"{self.ckpt}: two entries map to the DCP key {k!r}")
            self.tensors[k], self.paths[k], self.chunks[k] = (dtype, shape), path, []

    # -- writing --------------------------------------------------------------------------------------
    def write(self) -> None:
        with ReadPlan(files_dir(self.ckpt, self.doc), self.doc["files"]) as plan:
            for r in sorted(set(self.jobs) | {0}):
                name = f"__{r}_0.distcp"
                with open(os.path.join(self.tmp, name), "w+b") as f:
                    if r == 0:
                        self._write_values(f, name)
                    self._write_jobs(plan, f, name, self.jobs.get(r, []))
                    f.flush()
                    os.fsync(f.fileno())

    def _write_values(self, f, name: str) -> None:
        for key, path, v in self.values:
            self.value_storage[key] = (name, *_write_item(f, pickle.dumps(v, protocol=2)))
            self.paths[key] = path

    def _write_jobs(self, plan: ReadPlan, f, name: str, jobs: list[_Job]) -> None:
        batch, size = [], 0
        for job in jobs + [None]:
            if job is None or (batch and size + job.nbytes > BUFFER_BYTES):
                bufs = [self._read(plan, j) for j in batch]
                plan.execute()
                for j, buf in zip(batch, bufs):
                    self._emit(f, name, j, lambda write, buf=buf: write(memoryview(buf.numpy())))
                batch, size = [], 0
            if job is None:
                break
            if job.nbytes > BUFFER_BYTES:   # streamed in windows of BUFFER_BYTES
                self._emit(f, name, job, lambda write, job=job: self._stream(plan, job, write))
            else:
                batch.append(job)
                size += job.nbytes

    def _read(self, plan: ReadPlan, job: _Job, skip: int = 0, n: int | None = None) -> torch.Tensor:
        """Queue (``plan.execute()`` performs) bytes ``[skip, skip + n)`` of the job into a new buffer."""
        n = job.nbytes - skip if n is None else n
        if isinstance(job.src, torch.Tensor):
            return job.src.view(-1).view(torch.uint8)[skip:skip + n]
        fname, file_key, rel = job.src
        e = plan.header(fname).entries.get(file_key)
        if e is None:
            raise CheckpointError(f"{os.path.join(self.ckpt, fname)}: tensor {file_key!r} is missing from its header")
        buf = torch.empty(n, dtype=torch.uint8)
        plan.add(fname, e.begin + rel + skip, torch.uint8, buf, file_key)
        return buf

    def _stream(self, plan: ReadPlan, job: _Job, write) -> None:
        for skip in range(0, job.nbytes, BUFFER_BYTES):
            buf = self._read(plan, job, skip, min(BUFFER_BYTES, job.nbytes - skip))
            plan.execute()
            write(memoryview(buf.numpy()))

    def _emit(self, f, name: str, job: _Job, data) -> None:
        off, length = _write_item(f, _tensor_pickle(job.dtype, job.sizes), data, job.nbytes)
        for k in job.keys:
            self.chunks[k].append((job.offsets, job.sizes, name, off, length))

    def metadata(self):
        """DCP's ``Metadata`` of everything written (torch's own classes, so ``dcp.load`` reads it)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        sd_meta, storage = {}, {}
        for key, (dtype, shape) in self.tensors.items():
            chunks = []
            for i, (off, sz, name, o, n) in enumerate(self.chunks[key]):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
                storage[MetadataIndex(key, torch.Size(off), i)] = _StorageInfo(name, o, n)
            sd_meta[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), chunks)
        for key, (name, o, n) in self.value_storage.items():
            sd_meta[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(name, o, n)
        return Metadata(state_dict_metadata=sd_meta, planner_data=dict(self.paths), storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=None, save_id=uuid.uuid4().hex), version="1.0.0")


def export_dcp(ckpt, out) -> str:
    """Write checkpoint ``ckpt`` as DCP directory ``out`` (see module docstring); return ``out``.

    ``out`` may be an fsspec URL: the directory is built in a local temporary directory and uploaded, one object
    per file, ``.metadata`` last (DCP's commit marker: a reader sees nothing before it exists)."""
    ckpt = checkpoint_dir(resolve(ckpt, "export_dcp"))  # also an accelerate / Trainer / Lightning dir; or a URL
    out = resolve(out, "export_dcp (its output)")
    if is_url(out):
        return _export_to_url(ckpt, out)
    doc = manifest.read(ckpt)
    if os.path.exists(out):
        raise CheckpointError(f"{out} already exists: give a new directory (an export never replaces anything)")
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        ex = _Exporter(ckpt, tmp, doc)
        _model_section(ex, doc)
        for i, o in enumerate(doc.get("optimizers", [])):
            _optimizer_section(ex, o, i, "optimizer" if len(doc["optimizers"]) == 1 else f"optimizer_{i}")
        _extra_section(ex, ckpt, doc)
        ex.write()
        with open(os.path.join(tmp, ".metadata"), "wb") as f:
            pickle.dump(ex.metadata(), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp, directory=True)
        os.rename(tmp, out)
        fsync_path(os.path.dirname(os.path.abspath(out)), directory=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _export_to_url(ckpt: str, url: str) -> str:
    st = storage_for(url)
    if st.listdir(url):
        raise CheckpointError(f"{url} already holds objects: give a new prefix (an export never replaces anything)")
    with tempfile.TemporaryDirectory(prefix="fsdp_plugin_dcp_") as d:
        local = export_dcp(ckpt, os.path.join(d, "dcp"))
        for name in sorted(os.listdir(local), key=lambda n: (n == METADATA_FILE, n)):
            st.put_file(os.path.join(local, name), join(url, name))
    return url


def _model_section(ex: _Exporter, doc: dict) -> None:
    aliases: dict[str, list[str]] = {}
    for n, e in doc["params"].items():
        if "alias_of" in e:
            aliases.setdefault(e["alias_of"], []).append(n)
    for n, e in doc["params"].items():
        if "alias_of" not in e:
            names = [n, *aliases.get(n, [])]
            ex.stored([(f"model.{k}", ("model", k)) for k in names], e, "model", n)
    for n, e in doc["buffers"].items():
        ex.stored([(f"model.{n}", ("model", n))], e, "model", n)


def _optimizer_section(ex: _Exporter, o: dict, i: int, top: str) -> None:
    for fqn, states in o.get("tensors", {}).items():
        for key, e in states.items():
            ex.stored([(f"{top}.state.{fqn}.{key}", (top, "state", fqn, key))], e, "optim",
                      manifest.tensor_key("optim", fqn, i, key))
    for fqn, states in o.get("scalars", {}).items():
        for key, node in states.items():
            v = codec.decode(node, None, f"optimizer[{i}].state.{fqn}.{key}")
            ex.value(f"{top}.state.{fqn}.{key}", (top, "state", fqn, key), v)
    for j, g in enumerate(o["param_groups"]):
        for hp, node in g.items():
            v = list(node) if hp == "params" else codec.decode(node, None, f"optimizer[{i}].param_groups[{j}].{hp}")
            ex.value(f"{top}.param_groups.{j}.{hp}", (top, "param_groups", j, hp), v)


def _extra_section(ex: _Exporter, ckpt: str, doc: dict) -> None:
    """Rank 0's ``extra`` under ``extra.<path>`` (dicts nested; other values are leaves)."""
    from ..load import _plan_extra

    with ReadPlan(files_dir(ckpt, doc), doc["files"]) as plan:
        extra = _plan_extra(plan, doc, ckpt)
        plan.execute()
    if extra is None:
        return

    def walk(node, path: tuple) -> None:
        if isinstance(node, dict) and node and all(isinstance(k, (str, int)) for k in node):
            for k, v in node.items():
                walk(v, path + (k,))
        else:
            ex.value(".".join(map(str, path)), path, node)

    walk(extra if isinstance(extra, dict) else {"value": extra}, ("extra",))
