"""Offline inspection and verification of checkpoint directories (used by the ``fsdp-plugin`` CLI)."""
from __future__ import annotations

import os
import zlib

from .format import _format, boxes, layouts, manifest
from .errors import CheckpointError
from .storage.fsio import preadv_all
from .format.reader import ReadPlan
from .storage import files_dir, resolve


def inspect_checkpoint(path) -> dict:
    """Summary of a checkpoint: parameters (name, shape, dtype), world size and strategy at save, bytes on
    disk per file, optimizers, and ``extra`` (as stored: JSON with tagged values); ``layout``: what ``path``
    is (an accelerate state, a Trainer checkpoint...) and ``path``: the fsdp_plugin directory inside it shown."""
    path = resolve(path, "inspect")
    layout = layouts.detect(path)
    path = layouts.checkpoint_dir(path)
    doc = manifest.read(path)
    params = {n: ({"alias_of": e["alias_of"]} if "alias_of" in e else
                  {"shape": e["shape"], "dtype": e["dtype"], "requires_grad": e.get("requires_grad", True)})
              for n, e in doc["params"].items()}
    stored = [e for e in doc["params"].values() if "alias_of" not in e]
    return {
        "path": os.fspath(path), "uuid": doc.get("uuid"), "created_unix": doc.get("created_unix"),
        "producer": doc.get("producer"), "world_size": doc["world_size"], "sharding": doc.get("sharding"),
        "num_params": len(stored), "num_elements": sum(_format.numel(e["shape"]) for e in stored),
        "params": params, "buffers": {n: {"shape": e["shape"], "dtype": e["dtype"]} for n, e in doc["buffers"].items()},
        "files": {n: r["bytes"] for n, r in doc["files"].items()},
        "bytes_on_disk": sum(r["bytes"] for r in doc["files"].values()),
        "optimizers": [{"class": o.get("class"), "param_groups": len(o["param_groups"]),
                        "state_keys": sorted({k for s in o.get("tensors", {}).values() for k in s}
                                             | {k for s in o.get("scalars", {}).values() for k in s})}
                       for o in doc.get("optimizers", [])],
        "extra": doc.get("extra", {}),
        "layout": {"kind": layout.kind, "path": layout.path, "summary": layout.summary, "reads": layout.reads},
    }


def verify_checkpoint(path, progress=None) -> list[str]:
    """Check every file of ``path``: size, header, every tensor against the manifest, every CRC32 block.

    Returns a list of problems (empty: the checkpoint is intact). ``progress(done, total)`` per block.
    """
    try:
        path = layouts.checkpoint_dir(resolve(path, "verify"))
        doc = manifest.read(path)
    except CheckpointError as e:
        return [str(e)]
    problems, done = [], 0
    total = sum(r["bytes"] for r in doc["files"].values())
    expected = _expected_entries(doc)
    with ReadPlan(files_dir(path, doc), doc["files"]) as plan:
        for name, rec in sorted(doc["files"].items()):
            try:
                header = plan.header(name)
                problems += _check_entries(name, header, expected.get(name, {}))
                fd, where = plan.fd(name)
                done = _check_crc(fd, where, rec, progress, done, total, problems)
            except CheckpointError as e:
                problems.append(str(e))
                done += rec["bytes"]
    return problems


def _expected_entries(doc: dict) -> dict[str, dict[str, tuple]]:
    """file name -> {key: (dtype, (numel,))} for every piece the manifest promises."""
    out: dict[str, dict[str, tuple]] = {}

    def add(kind, key, e):
        for p in e["pieces"]:
            out.setdefault(manifest.file_name(p[0], kind), {})[key] = (e["dtype"], (boxes.piece_numel(p),))

    for n, e in doc["params"].items():
        if "alias_of" not in e:
            add("model", n, e)
    for n, e in doc["buffers"].items():
        add("model", n, e)
    for i, o in enumerate(doc.get("optimizers", [])):
        for fqn, states in o.get("tensors", {}).items():
            for key, e in states.items():
                add("optim", manifest.tensor_key("optim", fqn, i, key), e)
    return out


def _check_entries(name: str, header, expected: dict) -> list[str]:
    problems = []
    for key, (dtype, shape) in expected.items():
        e = header.entries.get(key)
        if e is None or e.dtype != dtype or e.shape != shape:
            problems.append(f"{name}: tensor {key!r} missing or not {dtype} {list(shape)} in the file header")
    return problems


def _check_crc(fd: int, where: str, rec: dict, progress, done: int, total: int, problems: list) -> int:
    bsz = rec["block_bytes"]
    buf = bytearray(bsz)
    for k, crc in enumerate(rec["crc32"]):
        lo, hi = k * bsz, min((k + 1) * bsz, rec["bytes"])
        view = memoryview(buf)[: hi - lo]
        preadv_all(fd, [view], lo, where)
        if zlib.crc32(view) != crc:
            problems.append(f"{where}: block {k} (bytes {lo:,}-{hi:,}) fails its CRC32 check")
        done += hi - lo
        if progress:
            progress(done, total)
    return done
