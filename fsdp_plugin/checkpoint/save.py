"""``save_checkpoint``: every rank writes only its own pieces; rank 0 writes the manifest last.

Protocol (see docs in :mod:`.manifest` and :mod:`._publish`):

1. rank 0 picks a uuid, checks ``path`` may be replaced, removes stale ``.tmp-*`` siblings and creates
   ``path.tmp-<uuid>``; everyone learns the uuid (broadcast) and whether that worked.
2. every rank writes ``rank<r>.{model,optim,extra}.safetensors`` (only the pieces with
   ``ParamShard.writer``; buffers on rank 0), fsyncing each, and describes them in a small JSON record.
3. the records are gathered to rank 0 (JSON bytes, no pickle); rank 0 builds and validates the manifest,
   writes ``manifest.json`` (fsync, rename), fsyncs the directory and publishes it atomically.
4. a failure on any rank makes every rank raise; rank 0 removes the temporary directory.
"""
from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from .._comm import failure, native
from .asyncsave import _async
from . import _comm, _model, optim
from .format import _format, boxes, codec, manifest
from .storage import _publish, _publish_remote
from .errors import CheckpointError
from .storage import is_url, join, resolve, storage_for
from .format.writer import write_safetensors


@dataclass
class _Job:
    """Everything the write + publish half of a save needs (no reference to the live model)."""

    path: str                    # the published location
    rank: int
    world: int
    uid: str
    record: dict                 # this rank's JSON record; ``files`` is filled by the write
    files: list                  # (kind, [(name, tensor, stored_shape)]) in file order
    sharding: dict | None        # rank 0 only: the manifest's sharding description
    base: object = None          # rank 0, object store: the checkpoint this save replaces (_publish_remote.Base)


@_comm.uses_model_deadline
def save_checkpoint(path, model, optimizer=None, extra=None, *,
                    async_save: bool | Literal["deferred"] = False) -> _async.AsyncSave | None:
    """Save ``model`` (+ optimizer(s), + ``extra``) as a sharded checkpoint directory at ``path``.

    Collective: every rank of the default process group must call it with the same ``path`` and
    ``async_save``. ``optimizer``: None, one optimizer or a list. ``extra``: per-rank JSON-able data (see
    :mod:`.codec`); tensors in it are stored in the rank's ``extra`` file.

    ``async_save=True`` copies this rank's pieces to host memory (reusing the previous save's buffers:
    one extra host copy of the local state stays allocated), then returns an :class:`AsyncSave` handle
    while a background thread writes, checksums and publishes; the files hold the values at the call.
    ``async_save="deferred"`` returns before the copy: the checkpoint thread makes it first, and every
    torch optimizer's ``step()`` (and the next save/load) waits until it is made; buffers and ``extra``
    are still copied at the call. Until ``handle.snapshot_done()``, parameters and optimizer state must
    only change through an optimizer step. A pending save is waited for by the next save or load and by
    normal process exit. Returns None when synchronous.
    """
    if async_save not in (False, True, "deferred"):
        raise CheckpointError(f"async_save must be False, True or 'deferred', not {async_save!r}")
    failure.refuse("fp.save_checkpoint")
    _async.wait_pending()
    path = resolve(path, "save_checkpoint")
    rank, world = _comm.rank(), _comm.world_size()
    uid, base = _begin(path, rank)
    tmp = _publish.tmp_name(path, uid)
    stager = _async.Stager(model, deferred=async_save == "deferred") if async_save else None
    group = _async.checkpoint_group() if async_save else None
    err, job = None, None
    try:
        job = _snapshot(path, rank, world, uid, model, optim.as_list(optimizer), extra, stager)
        job.base = base
        if stager is not None:
            stager.finish()
    except Exception as e:  # noqa: BLE001 - propagated to every rank
        err = e
    if not async_save:
        return _write_and_publish(err, tmp, job)
    _fail_and_clean(err, tmp, rank)
    return _async.start(path, lambda e: _write_and_publish(e, tmp, job, group), stager)


def _begin(path: str, rank: int) -> tuple[str, object]:
    """Collective: rank 0 prepares ``path.tmp-<uid>``; every rank returns the uid (or raises), and rank 0 what an
    object store's publication is conditional on (None elsewhere)."""
    err, uid, base = None, None, None
    if rank == 0:
        uid = uuid.uuid4().hex
        try:
            base = _prepare(path, uid)
        except Exception as e:  # noqa: BLE001 - propagated to every rank below
            err = e
    uid = _comm.broadcast_bytes(uid.encode() if uid else None).decode()
    _comm.raise_if_any_failed(err)
    return uid, base


def _write_and_publish(err, tmp: str, job, group=None) -> None:
    """Collective over ``group``: write this rank's files, gather the records, rank 0 publishes."""
    rank = _comm.rank()
    if err is None:
        try:
            _write_files(tmp, job)
        except Exception as e:  # noqa: BLE001
            err = e
    _fail_and_clean(err, tmp, rank, group)
    if native.is_fake():
        _discard_fake(tmp, rank)
        return
    records = _comm.gather_bytes(json.dumps(job.record).encode(), group=group)
    if rank == 0:
        try:
            doc = _build_manifest([json.loads(r) for r in records], job.uid, job.world, job.sharding)
            if is_url(job.path):
                _publish_remote.publish(tmp, job.path, _manifest_bytes(_publish_remote.stamped(doc)), job.base)
            else:
                _write_manifest(tmp, doc)
                _publish.publish(tmp, job.path)
        except Exception as e:  # noqa: BLE001
            err = e
    _fail_and_clean(err, tmp, rank, group)
    failure.saved(job.path)


def _discard_fake(tmp: str, rank: int) -> None:
    """torch's fake process group: this process plays one rank of a world that does not exist, so it wrote that
    rank's files (their bytes and the host memory of writing them are real: what a memory estimate wants) but
    publishes no checkpoint, which could never be complete: the staging directory is removed, and a warning
    (shown once per call site, Python's default) says so."""
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp) for f in fs)
    storage_for(tmp).remove_tree(tmp)
    warnings.warn(f"fsdp_plugin: fake process group: fp.save_checkpoint wrote rank {rank}'s files ({written:,} "
                  "bytes) and published nothing: the other ranks are not real, so there is no checkpoint to load.",
                  stacklevel=4)


def _prepare(path: str, uid: str):
    """Rank 0; returns what the publication of an object-store save is conditional on (None locally)."""
    if is_url(path):  # an object store: nothing to create; the save's objects go under path/<uid>
        return _publish_remote.prepare(path)
    _publish.check_replaceable(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _publish.clean_stale(path)
    os.mkdir(_publish.tmp_name(path, uid))
    return None


def _fail_and_clean(err, tmp: str, rank: int, group=None) -> None:
    try:
        _comm.raise_if_any_failed(err, group=group)
    except BaseException:
        if rank == 0:
            storage_for(tmp).remove_tree(tmp)
        raise


def _snapshot(path: str, rank: int, world: int, uid: str, model, optimizers: list, extra, stage) -> _Job:
    """This rank's record and tensors; ``stage`` (async) copies every tensor to host memory now."""
    stage = stage or (lambda t, large=False: t)
    shards = _model.param_shards(model, boxes=True)
    shard_of = {id(sh.param): sh for sh in shards}
    model_tensors, pieces = [], {}
    for sh in shards:
        if sh.writer and sh.end > sh.start:
            local = sh.param.detach().reshape(-1)
            assert local.numel() == sh.end - sh.start, f"{sh.fqn}: local piece has {local.numel()} elements"
            model_tensors.append((sh.fqn, stage(local, True), (local.numel(),)))
            pieces[sh.fqn] = [sh.start, sh.end] if sh.box is None else [list(sh.box[0]), list(sh.box[1])]
    rec: dict = {"rank": rank, "pieces": pieces, "files": {}}
    if rank == 0:
        rec["params"] = {sh.fqn: _param_meta(sh) for sh in shards}
        rec["buffers"] = {}
        for name, buf in _model.persistent_buffers(model):
            model_tensors.append((name, stage(buf), (buf.numel(),)))
            rec["buffers"][name] = {"shape": list(buf.shape), "dtype": _format.dtype_name(buf.dtype)}
    opt_tensors: list = []
    rec["optimizers"] = optim.local_record(optimizers, shard_of, opt_tensors)
    extra_tensors: list = []
    rec["extra"] = codec.encode(extra, _extra_sink(extra_tensors, stage), "extra")
    rec["extra_has_tensors"] = bool(extra_tensors)
    files = [("model", model_tensors), ("optim", [(k, stage(t, True), (t.numel(),)) for k, t in opt_tensors]),
             ("extra", extra_tensors)]
    sharding = _model.sharding_description(model) if rank == 0 else None
    return _Job(path, rank, world, uid, rec, files, sharding)


def _write_files(tmp: str, job: _Job) -> None:
    """Write this rank's non-empty files into ``tmp`` and describe them in ``job.record["files"]``."""
    meta = {"format": "pt", "producer": "fsdp_plugin", "rank": str(job.rank), "world_size": str(job.world),
            "uuid": job.uid}
    for kind, tensors in job.files:
        if tensors:
            name = manifest.file_name(job.rank, kind)
            job.record["files"][name] = write_safetensors(join(tmp, name), tensors,
                                                          dict(meta, kind=kind)).to_json()


def _param_meta(sh) -> dict:
    return {"shape": list(sh.shape), "dtype": _format.dtype_name(sh.dtype),
            "requires_grad": bool(sh.param.requires_grad), "aliases": list(sh.aliases)}


def _extra_sink(out: list, stage):
    def sink(path: str, t: torch.Tensor) -> dict:
        out.append((path, stage(t), (t.numel(),)))  # stored 1-D, like every piece; the shape is in the manifest
        return {codec.TAG: "tensor_ref", "key": path, "dtype": _format.dtype_name(t.dtype), "shape": list(t.shape)}

    return sink


def _build_manifest(records: list[dict], uid: str, world: int, sharding: dict) -> dict:
    """Merge the per-rank records (indexed by rank) into the manifest; validate it."""
    r0 = records[0]
    params, buffers = {}, {}
    for fqn, meta in r0["params"].items():
        params[fqn] = {k: meta[k] for k in ("shape", "dtype", "requires_grad")}
        params[fqn]["pieces"] = sorted(([r["rank"], *r["pieces"][fqn]] for r in records if fqn in r["pieces"]),
                                        key=lambda p: boxes.piece_start(p, meta["shape"]))
        for alias in meta["aliases"]:
            params[alias] = {"alias_of": fqn}
    params = {k: params[k] for k in sorted(params, key=lambda k: "alias_of" in params[k])}
    for name, meta in r0["buffers"].items():
        n = _format.numel(meta["shape"])
        buffers[name] = dict(meta, pieces=[[0, 0, n]] if n else [])
    optimizers = _merge_optimizers(records)
    entries = [*params.values(), *(e for o in optimizers for st in o["tensors"].values() for e in st.values())]
    # version 1 when every piece is a range: a checkpoint of a model without TP stays readable by older readers
    has_boxes = any(boxes.is_box(p) for e in entries for p in e.get("pieces", ()))
    doc = {"format": manifest.FORMAT, "version": manifest.VERSION if has_boxes else 1, "uuid": uid,
           "created_unix": time.time(),
           "producer": {"fsdp_plugin": _version(), "torch": torch.__version__},
           "world_size": world, "sharding": sharding,
           "files": {n: f for r in records for n, f in r["files"].items()},
           "params": params, "buffers": buffers,
           "optimizers": optimizers, "extra": _merge_extra(records)}
    manifest.validate(doc, "manifest being saved")
    return doc


def _merge_optimizers(records: list[dict]) -> list[dict]:
    out = []
    for i, o0 in enumerate(records[0]["optimizers"]):
        tensors, scalars = {}, {}
        for r in records:
            o = r["optimizers"][i]
            for fqn, states in o["tensors"].items():
                for key, t in states.items():
                    e = tensors.setdefault(fqn, {}).setdefault(key, {"shape": t["shape"], "dtype": t["dtype"],
                                                                     "pieces": []})
                    if "box" in t:
                        e["pieces"].append([r["rank"], *t["box"]])
                    elif t["end"] > t["start"]:
                        e["pieces"].append([r["rank"], t["start"], t["end"]])
            for fqn, states in o["scalars"].items():
                for key, v in states.items():
                    scalars.setdefault(fqn, {}).setdefault(key, v)
        for states in tensors.values():
            for e in states.values():
                e["pieces"].sort(key=lambda p, shape=e["shape"]: boxes.piece_start(p, shape))
        out.append({"class": o0["class"], "param_groups": o0["param_groups"], "tensors": tensors,
                    "scalars": scalars})
    return out


def _merge_extra(records: list[dict]) -> dict:
    base = json.dumps(records[0]["extra"], sort_keys=True)
    out = {"0": records[0]["extra"]}
    for r in records[1:]:
        if r["extra_has_tensors"] or json.dumps(r["extra"], sort_keys=True) != base:
            out[str(r["rank"])] = r["extra"]
    return out


def _write_manifest(tmp: str, doc: dict) -> None:
    part = os.path.join(tmp, manifest.NAME + ".tmp")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(_manifest_bytes(doc))
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(part, os.path.join(tmp, manifest.NAME))  # the directory is fsynced by _publish.publish


def _manifest_bytes(doc: dict) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fsdp_plugin")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"
