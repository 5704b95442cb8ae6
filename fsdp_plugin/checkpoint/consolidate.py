"""Offline export of a checkpoint directory to Hugging Face safetensors (no process group).

Each rank model file is read once, sequentially, in CRC32 blocks (one reused block buffer: memory is
O(block), 8 MiB by default); each block is checked against the manifest and the bytes of the pieces it
holds are ``pwrite``-n to their precomputed offsets in the output files. Outputs are fsynced and renamed
into place, the index last. Tied aliases are written under every name (or, on request, once); optimizer state and extras are not exported.
"""
from __future__ import annotations

import os
import uuid
import zlib

from .format import _format, boxes, layouts, manifest
from .errors import CorruptCheckpointError
from .storage import files_dir, require_local, resolve
from .storage.fsio import preadv_all
from .hf.hf_out import HFWriter
from .format.reader import ReadPlan


def consolidate(ckpt, out, max_shard_size="5GB", progress=None, keep_tied: bool = True) -> list[str]:
    """Export checkpoint ``ckpt`` to HF safetensors in directory ``out``; return the output file names.

    With ``keep_tied`` (default) a tied parameter is written under every name, so the output loads into
    the plain model with a strict ``load_state_dict`` (HF loaders re-tie it anyway); ``keep_tied=False``
    drops the aliases like ``save_pretrained`` and the hub do.
    ``progress(done_bytes, total_bytes)`` is called after every block when given.
    """
    ckpt = layouts.checkpoint_dir(resolve(ckpt, "consolidate"))  # a local directory or a URL
    out = require_local(out, "consolidate (its output)")
    doc = manifest.read(ckpt)
    tensors = {}  # output name -> (stored name, manifest entry)
    for n, e in doc["params"].items():
        if "alias_of" not in e:
            tensors[n] = (n, e)
        elif keep_tied:
            tensors[n] = (e["alias_of"], doc["params"][e["alias_of"]])
    tensors.update({n: (n, e) for n, e in doc["buffers"].items()})
    entries = [(n, e["dtype"], tuple(e["shape"])) for n, (_, e) in tensors.items()]
    writer = HFWriter(out, entries, max_shard_size, uuid.uuid4().hex)
    writer.create()
    try:
        _copy_all(ckpt, doc, tensors, writer, progress)
        writer.sync_close()
        writer.publish()
    except BaseException:
        writer.abort()
        raise
    return list(writer.names)


def _copy_all(ckpt: str, doc: dict, tensors: dict, writer: HFWriter, progress) -> None:
    by_file: dict[str, list] = {}
    for name, (stored, e) in tensors.items():
        for piece in e["pieces"]:
            by_file.setdefault(manifest.file_name(piece[0], "model"), []).append((name, stored, e, piece))
    total = sum(doc["files"][f]["bytes"] for f in by_file)
    done = 0
    with ReadPlan(files_dir(ckpt, doc), doc["files"]) as plan:
        for fname in sorted(by_file):
            header = plan.header(fname)
            spans = sorted(_spans(ckpt, fname, header, by_file[fname]))
            done = _copy_file(plan, fname, spans, writer, progress, done, total)


def _spans(ckpt, fname, header, pieces):
    """``(file_begin, file_end, output_name, elem_start)`` per run of each piece (a range is one run, a
    tensor-parallel box one per row it does not span whole), checked against the manifest."""
    for name, stored, e, piece in pieces:
        h, n = header.entries.get(stored), boxes.piece_numel(piece)
        if h is None or h.dtype != e["dtype"] or h.shape != (n,):
            raise CorruptCheckpointError(f"{os.path.join(ckpt, fname)}: tensor {stored!r} in the file header does not "
                                         f"match manifest.json ({e['dtype']} [{n}])")
        isz, pos = _format.itemsize(e["dtype"]), h.begin
        for a, k in boxes.piece_runs(piece, e["shape"]):
            yield pos, pos + k * isz, name, a
            pos += k * isz


def _copy_file(plan: ReadPlan, fname: str, spans: list, writer: HFWriter, progress, done: int, total: int) -> int:
    """Stream ``fname`` block by block, verifying CRC32s; route piece bytes to the writer."""
    rec = plan.records[fname]
    fd, where = plan.fd(fname)
    bsz = rec["block_bytes"]
    buf = bytearray(bsz)
    j = 0
    for k, expected in enumerate(rec["crc32"]):
        lo, hi = k * bsz, min((k + 1) * bsz, rec["bytes"])
        view = memoryview(buf)[: hi - lo]
        preadv_all(fd, [view], lo, where)
        if zlib.crc32(view) != expected:
            raise CorruptCheckpointError(f"{where}: block {k} (bytes {lo:,}-{hi:,}) fails its CRC32 check: the file "
                                         "is corrupted")
        while j < len(spans) and spans[j][1] <= lo:
            j += 1
        i = j
        while i < len(spans) and spans[i][0] < hi:
            b0, b1, name, a = spans[i]
            s, e = max(b0, lo), min(b1, hi)
            isz = _format.itemsize(writer.place[name].dtype)
            writer.pwrite(name, a + (s - b0) // isz, view[s - lo:e - lo])
            i += 1
        done += hi - lo
        if progress:
            progress(done, total)
    return done


def state_entries(ckpt) -> list[tuple[str, str, tuple]]:
    """``(name, dtype, shape)`` of the plain model's tensors in the order the Lightning export writes them
    (parameters, buffers, then tied aliases)."""
    doc = manifest.read(layouts.checkpoint_dir(ckpt))
    tensors = _state_tensors(doc)
    return [(n, e["dtype"], tuple(e["shape"])) for n, (_, e) in tensors.items()]


def stream_state(ckpt, writer, progress=None) -> None:
    """Copy every tensor of :func:`state_entries` into ``writer`` (``writer.place[name].dtype``,
    ``writer.pwrite(name, elem_start, bytes)``), each rank file read once in CRC32-checked blocks: O(block) memory."""
    ckpt = layouts.checkpoint_dir(ckpt)
    doc = manifest.read(ckpt)
    _copy_all(ckpt, doc, _state_tensors(doc), writer, progress)


def read_extra(ckpt):
    """The decoded ``extra`` of checkpoint ``ckpt`` (no weights read)."""
    from .load import _plan_extra

    ckpt = layouts.checkpoint_dir(resolve(ckpt, "read_extra"))
    doc = manifest.read(ckpt)
    with ReadPlan(files_dir(ckpt, doc), doc["files"]) as plan:
        extra = _plan_extra(plan, doc, ckpt)
        plan.execute()
    return extra


def _state_tensors(doc: dict) -> dict:
    """output name -> (stored name, manifest entry), parameters, buffers, then tied aliases."""
    params = {n: e for n, e in doc["params"].items() if "alias_of" not in e}
    tensors = {n: (n, e) for n, e in params.items()}
    tensors.update({n: (n, e) for n, e in doc["buffers"].items()})
    tensors.update({n: (e["alias_of"], doc["params"][e["alias_of"]]) for n, e in doc["params"].items()
                    if "alias_of" in e})
    return tensors
