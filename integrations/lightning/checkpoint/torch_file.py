"""The ``full`` Lightning checkpoint file: Lightning's own torch format, which we read without unpickling.

Layout: exactly what ``torch.save({"state_dict": weights, **lightning_state})`` writes (a zip archive of
``data.pkl`` and one raw, uncompressed record per tensor storage), plus one JSON record,
``fsdp_plugin.json``, that lists every weight's storage record, dtype and shape and carries whatever the
caller wants to read back (Lightning's state through the pickle-free codec).

* Lightning reads it like any of its checkpoints: ``MyModule.load_from_checkpoint(path)`` or
  ``torch.load(path, weights_only=True)`` (torch's restricted unpickler: tensors, containers, primitives).
* fsdp_plugin never unpickles it: :func:`read` opens the zip, parses the JSON record and copies each
  weight's raw bytes into a fresh tensor (``zipfile`` checks every record's CRC32).

Why the index is exact: ``torch.save`` numbers storages ``0, 1, ...`` in the order the pickler first meets
them; ``state_dict`` is the payload's first key and every weight gets a storage of its own, so weight ``i``
is record ``data/i``. :func:`write` checks this against each record's size and CRC32 before publishing.
"""
from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from fsdp_plugin.checkpoint.format.codec import torch_dtype
from fsdp_plugin.checkpoint.hf.ranged import attempt
from fsdp_plugin.checkpoint.errors import CheckpointError, CorruptCheckpointError

INDEX_RECORD = "fsdp_plugin.json"
FORMAT = "fsdp_plugin.lightning_full"
VERSION = 1
_ZIP_MAGIC = b"PK\x03\x04"


def is_torch_file(path: Path) -> bool:
    """Whether ``path`` is a zip archive (torch's format) rather than, e.g., a safetensors file."""
    with open(path, "rb") as f:
        return f.read(4) == _ZIP_MAGIC


def write(path: Path, state: dict[str, torch.Tensor], lightning_state: dict[str, Any], index_extra: Any) -> None:
    """Atomically write ``{"state_dict": state, **lightning_state}`` at ``path``, plus our JSON index.

    ``index_extra`` (strict JSON) is stored in the index and returned by :func:`read`. Memory: the weights
    are written from ``state`` as given (a tensor is copied only if it shares or does not fill its storage).
    """
    if "state_dict" in lightning_state:
        raise ValueError("lightning_state must not hold 'state_dict': the weights are passed separately")
    own = _own_storages(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save({"state_dict": own, **lightning_state}, tmp)
        with zipfile.ZipFile(tmp, "a") as zf:
            prefix = _prefix(zf)
            index = {"format": FORMAT, "version": VERSION, "tensors": _index(zf, prefix, own), "extra": index_extra}
            zf.writestr(prefix + INDEX_RECORD, json.dumps(index, allow_nan=False))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_sharded(path: Path, model: torch.nn.Module, lightning_state: dict[str, Any], index_extra: Any) -> None:
    """Collective: :func:`write` of the sharded ``model``'s plain weights, with no rank holding more than its shard.

    Rank 0 lays the archive out with ``torch.save`` of fake tensors under ``skip_data`` (every storage record at
    its final offset, empty), every rank writes its byte ranges into the records (``ranged.fill_existing``),
    rank 0 fills in the CRC32s (:func:`fsdp_plugin.checkpoint.format.torch_zip.fix_crcs`, streaming), appends the
    index and publishes. Same records and bytes as :func:`write` of the gathered weights, but for the archive's
    folder name and torch's per-save ``serialization_id`` (which differ between any two saves) and the pickle
    memo of ``data.pkl`` (a location string repeated instead of referenced: the same unpickled value).
    """
    from fsdp_plugin.checkpoint import _comm
    from fsdp_plugin.checkpoint.hf import ranged

    if "state_dict" in lightning_state:
        raise ValueError("lightning_state must not hold 'state_dict': the weights are passed separately")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    layout = None

    def lay_out() -> None:
        nonlocal layout
        layout = _lay_out(tmp, model, lightning_state)

    try:
        err = attempt(lay_out) if _comm.rank() == 0 else None
        _comm.raise_if_any_failed(err, "laying out the Lightning file")
        ranged.fill_existing(model, str(tmp) if _comm.rank() == 0 else None, layout)
        err = attempt(lambda: _finish(tmp, path, layout, index_extra)) if _comm.rank() == 0 else None
        _comm.raise_if_any_failed(err, "publishing the Lightning file")
    finally:
        if _comm.rank() == 0 and tmp.exists():
            tmp.unlink()


def _lay_out(tmp: Path, model: torch.nn.Module, lightning_state: dict[str, Any]) -> list:
    """:func:`_lay_out_entries` for the plain ``model``'s state dict (stand-ins: no weights)."""
    from fsdp_plugin.checkpoint.hf import export_plan
    from fsdp_plugin.checkpoint.format._format import dtype_name

    stand_ins, _ = export_plan.placeholders(model)
    entries = [(k, dtype_name(t.dtype), tuple(t.shape)) for k, t in stand_ins.items()]
    return _lay_out_entries(tmp, entries, lightning_state)


def _lay_out_entries(tmp: Path, entries: list, lightning_state: dict[str, Any]) -> list:
    """``torch.save`` at ``tmp`` of fake weights ``(name, dtype, shape)`` (one storage each, as
    :func:`_own_storages` makes them); returns ``[[name, dtype, shape, runs (all of tensor name), data offset of data/i], ...]``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_plugin.checkpoint.format import torch_zip

    with FakeTensorMode():
        fakes = {n: torch.empty(shape, dtype=_torch_dtype(dt)) for n, dt, shape in entries}
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"state_dict": fakes, **lightning_state}, tmp)
    recs = torch_zip.records(str(tmp))
    plan = []
    for i, (name, dt, shape) in enumerate(entries):
        offset, size = recs[f"data/{i}"]
        if size != fakes[name].numel() * fakes[name].element_size():
            raise RuntimeError(f"torch.save stored weight {name!r} somewhere other than record data/{i}: "
                               "fsdp_plugin's index would be wrong (please report this with your torch version)")
        plan.append([name, dt, list(shape), [[0, name, 0, fakes[name].numel()]], offset])
    return plan


def write_streamed(path: Path, entries: list, lightning_state: dict[str, Any], index_extra: Any, fill) -> None:
    """:func:`write` with the weights ``(name, dtype, shape)`` supplied piece by piece: ``fill(target)`` calls
    ``target.pwrite(name, elem_start, bytes)`` (``target.place[name].dtype`` names the stored dtype), so the
    weights are never held (``fsdp-plugin consolidate --format lightning``). No process group."""
    if "state_dict" in lightning_state:
        raise ValueError("lightning_state must not hold 'state_dict': the weights are passed separately")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        layout = _lay_out_entries(tmp, entries, lightning_state)
        target = _ZipTarget(tmp, layout)
        try:
            fill(target)
        finally:
            target.close()
        _finish(tmp, path, layout, index_extra)
    finally:
        if tmp.exists():
            tmp.unlink()


class _ZipTarget:
    """``pwrite`` into the storage records of a laid-out archive (the interface consolidate's copy writes to)."""

    def __init__(self, tmp: Path, layout: list):
        from types import SimpleNamespace

        self.place = {n: SimpleNamespace(dtype=dt, offset=off) for n, dt, _shape, _runs, off in layout}
        self._fd = os.open(tmp, os.O_WRONLY)

    def pwrite(self, name: str, elem_start: int, data: memoryview) -> None:
        from fsdp_plugin.checkpoint.format._format import itemsize

        p = self.place[name]
        pos = p.offset + elem_start * itemsize(p.dtype)
        while len(data):
            n = os.pwrite(self._fd, data, pos)
            data, pos = data[n:], pos + n

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


def _finish(tmp: Path, path: Path, layout: list, index_extra: Any) -> None:
    from fsdp_plugin.checkpoint.format import torch_zip

    torch_zip.fix_crcs(str(tmp), [f"data/{i}" for i in range(len(layout))])
    tensors = {name: {"record": f"data/{i}", "dtype": str(_torch_dtype(dt)).removeprefix("torch."),
                      "shape": list(shape)} for i, (name, dt, shape, *_rest) in enumerate(layout)}
    with zipfile.ZipFile(tmp, "a") as zf:
        index = {"format": FORMAT, "version": VERSION, "tensors": tensors, "extra": index_extra}
        zf.writestr(_prefix(zf) + INDEX_RECORD, json.dumps(index, allow_nan=False))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _torch_dtype(name: str) -> torch.dtype:
    from fsdp_plugin.checkpoint.format._format import to_dtype

    return to_dtype(name)



def read(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """The weights and ``index_extra`` of a file :func:`write` wrote; no pickle is executed."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise CorruptCheckpointError(f"{path}: not a readable zip archive ({e}); the file is damaged") from None
    with zf:
        prefix = _prefix(zf)
        if prefix + INDEX_RECORD not in zf.namelist():
            raise CheckpointError(f"{path} is a torch checkpoint without fsdp_plugin's index ({INDEX_RECORD}): "
                                         "it was not written by FSDPPluginStrategy(state_dict_type='full') or "
                                         "`fsdp-plugin consolidate --format lightning`; load it with Lightning's "
                                         "own strategies instead")
        index = _read_index(zf, prefix, path)
        state = {name: _read_tensor(zf, prefix, entry, path, name) for name, entry in index["tensors"].items()}
    return state, index.get("extra")


def _own_storages(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors, each alone in a storage it fills exactly (copies only where needed: ties, views)."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        storage = t.untyped_storage()
        alone = (t.is_contiguous() and t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
                 and t.numel() > 0 and storage.data_ptr() not in seen)
        out[name] = t if alone else t.clone(memory_format=torch.contiguous_format)
        seen.add(out[name].untyped_storage().data_ptr())
    return out


def _prefix(zf: zipfile.ZipFile) -> str:
    """The archive's top folder (torch names it after the file), with a trailing slash."""
    for name in zf.namelist():
        if name.endswith("/data.pkl") and name.count("/") == 1:
            return name[: -len("data.pkl")]
    raise CorruptCheckpointError(f"{zf.filename}: no data.pkl record: not a torch checkpoint")


def _index(zf: zipfile.ZipFile, prefix: str, own: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Weight ``i`` is record ``data/i``; prove it by size and CRC32 before the file is published."""
    out = {}
    for i, (name, t) in enumerate(own.items()):
        record = f"data/{i}"
        info = zf.getinfo(prefix + record)
        raw = _bytes_of(t)
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != len(raw) or info.CRC != zlib.crc32(raw):
            raise RuntimeError(f"torch.save stored weight {name!r} somewhere other than record {record}: "
                               "fsdp_plugin's index would be wrong (please report this with your torch version)")
        out[name] = {"record": record, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    return out


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _read_index(zf: zipfile.ZipFile, prefix: str, path: Path) -> dict[str, Any]:
    try:
        index = json.loads(zf.read(prefix + INDEX_RECORD))
    except (ValueError, zipfile.BadZipFile) as e:
        raise CorruptCheckpointError(f"{path}: {INDEX_RECORD} is damaged ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("tensors"), dict):
        raise CorruptCheckpointError(f"{path}: {INDEX_RECORD} is not an fsdp_plugin Lightning index")
    if index.get("version") != VERSION:
        raise CorruptCheckpointError(f"{path}: index version {index.get('version')!r}; this fsdp_plugin reads "
                                     f"version {VERSION}: upgrade fsdp_plugin")
    byteorder = prefix + "byteorder"
    if byteorder in zf.namelist() and zf.read(byteorder) != b"little":
        raise CorruptCheckpointError(f"{path}: written on a big-endian machine; fsdp_plugin reads little-endian only")
    return index


def _read_tensor(zf: zipfile.ZipFile, prefix: str, entry: Any, path: Path, name: str) -> torch.Tensor:
    """Copy one stored record into a new tensor after checking dtype, shape and size against the index."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("record"), str)
          and isinstance(entry.get("shape"), list) and all(type(d) is int and d >= 0 for d in entry["shape"]))
    try:
        dtype = torch_dtype(entry["dtype"]) if ok else None
    except TypeError:
        dtype = None
    if dtype is None:
        raise CorruptCheckpointError(f"{path}: invalid index entry for {name!r}")
    out = torch.empty(entry["shape"], dtype=dtype)
    try:
        info = zf.getinfo(prefix + entry["record"])
    except KeyError:
        raise CorruptCheckpointError(f"{path}: record {entry['record']!r} of {name!r} is missing") from None
    nbytes = out.numel() * out.element_size()
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        raise CorruptCheckpointError(f"{path}: record {entry['record']!r} holds {info.file_size} bytes; {name!r} "
                                     f"({entry['dtype']} {entry['shape']}) needs {nbytes}")
    if nbytes:
        dest = _bytes_of(out)
        try:
            with zf.open(info) as f:  # zipfile verifies the CRC32 once the record is read to its end
                got = f.readinto(dest)
                if got != nbytes or f.read(1):
                    raise CorruptCheckpointError(f"{path}: record {entry['record']!r} is truncated")
        except zipfile.BadZipFile as e:
            raise CorruptCheckpointError(f"{path}: record {entry['record']!r} of {name!r}: {e}") from None
    return out
