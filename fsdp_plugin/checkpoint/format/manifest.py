"""``manifest.json``: the commit marker and table of contents of a checkpoint directory.

Schema (version 2; sizes in bytes, element ranges in elements of the row-major flattened tensor)::

    {"format": "fsdp_plugin.checkpoint", "version": 1, "uuid": str, "created_unix": float,
     "producer": {...}, "world_size": int, "sharding": {"strategy": ..., ...},
     "files": {"rank00000.model.safetensors": {"bytes", "data_start", "block_bytes", "crc32": [...]}},
     "params": {fqn: {"shape", "dtype", "requires_grad", "pieces": [[rank, start, stop], ...]}
                | {"alias_of": fqn}},
     "buffers": {name: {"shape", "dtype", "pieces"}},
     "optimizers": [{"class": str, "param_groups": [{"params": [fqn...], hyper-params (codec)}],
                     "tensors": {fqn: {key: {"shape", "dtype", "pieces"}}},
                     "scalars": {fqn: {key: codec value}}}],
     "extra": {"<rank>": codec tree}}

A piece ``[r, a, b]`` is stored in rank ``r``'s file of the section's kind (``model``, ``optim``) under the
key given by :func:`tensor_key`, as a 1-D tensor of ``b - a`` elements. Pieces are sorted, disjoint and
cover ``[0, numel)``. Version 2 adds box pieces ``[r, [offset, ...], [size, ...]]`` (a box of the global
tensor, stored 1-D in the box's row-major order; :mod:`.boxes`): a tensor's pieces are all ranges or all
boxes, boxes disjoint and tiling the tensor, sorted by their first element. ``sharding`` may carry ``tp_size``
(information only: loads never need it). Version 1 manifests (ranges only) are read unchanged.
:func:`validate` enforces all of this on read, before anything else is trusted.
"""
from __future__ import annotations

import os
import re

from . import _format, boxes
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..storage.fsio import open_in_dir
from ..storage import is_url, join, storage_for

FORMAT = "fsdp_plugin.checkpoint"
VERSION = 2
#: Versions this code reads (1: element ranges only).
READS = (1, 2)
NAME = "manifest.json"
#: Largest manifest we read (bytes).
MAX_MANIFEST_BYTES = 256 << 20
KINDS = ("model", "optim", "extra")
_FILE_RE = re.compile(r"^rank(\d{5,})\.(model|optim|extra)\.safetensors$")


def file_name(rank: int, kind: str) -> str:
    """Name of rank ``rank``'s file of ``kind`` (one of :data:`KINDS`)."""
    return f"rank{rank:05d}.{kind}.safetensors"


def tensor_key(kind: str, name: str, opt_index: int | None = None, state_key: str | None = None) -> str:
    """Key of a tensor inside a rank file: the FQN for model state, ``"<i>::<fqn>::<state key>"`` for
    optimizer state, the key path for ``extra`` tensors."""
    return f"{opt_index}::{name}::{state_key}" if kind == "optim" else name


def read(path: str) -> dict:
    """Read and validate ``path/manifest.json``; raise a precise error if absent or invalid."""
    if is_url(path):
        return _read_remote(path)
    if not os.path.isdir(path):
        raise CheckpointError(_missing_dir_message(path))
    where = os.path.join(path, NAME)
    if not os.path.lexists(where):
        # readers resolve the path with layouts.checkpoint_dir first (which says what else it is, and calls a save
        # interrupted only with evidence); here the manifest is simply absent
        raise CheckpointNotFoundError(f"{path} has no {NAME}, so it is not an fsdp_plugin checkpoint directory: "
                                      f"`fsdp-plugin inspect {path}` says what it is")
    fd = open_in_dir(path, NAME, where)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{where}: {size} bytes exceeds the {MAX_MANIFEST_BYTES}-byte cap")
        raw = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    doc = _format.strict_json_loads(raw, where)
    validate(doc, where)
    return doc


def _read_remote(path: str) -> dict:
    """The manifest of the checkpoint at object-store URL ``path`` (see :mod:`.remote`)."""
    where = join(path, NAME)
    raw = storage_for(path).read_small(where, MAX_MANIFEST_BYTES)
    if raw is None:
        raise CheckpointNotFoundError(f"{path}: no checkpoint there ({NAME} is absent: nothing was published at "
                                      "this URL, or its save did not finish)")
    doc = _format.strict_json_loads(raw, where)
    validate(doc, where)
    return doc


def _missing_dir_message(path: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    olds = sorted(n for n in (os.listdir(parent) if os.path.isdir(parent) else [])
                  if n.startswith(base + ".old-") and os.path.exists(os.path.join(parent, n, NAME)))
    if olds:
        return (f"{path} does not exist, but {os.path.join(parent, olds[-1])} is a complete checkpoint left by a "
                f"save interrupted while replacing it: rename it back to {path} to use it")
    return f"{path}: no such checkpoint directory"


# -- validation -----------------------------------------------------------------------------------------
def _fail(where: str, msg: str):
    raise CorruptCheckpointError(f"{where}: {msg}")


def _is_int(x, lo: int = 0) -> bool:
    return type(x) is int and x >= lo


def validate(doc, where: str) -> None:
    """Check the structure and invariants of a parsed manifest (see module docstring)."""
    if not isinstance(doc, dict):
        _fail(where, "not a JSON object")
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: format {doc.get('format')!r} is not {FORMAT!r}")
    if doc.get("version") not in READS:
        raise CheckpointError(f"{where}: format version {doc.get('version')!r} is not supported (this fsdp_plugin "
                              f"reads versions {', '.join(map(str, READS))}); upgrade fsdp_plugin")
    world = doc.get("world_size")
    if not _is_int(world, 1):
        _fail(where, f"invalid world_size {world!r}")
    files = doc.get("files")
    if not isinstance(files, dict):
        _fail(where, "'files' must be an object")
    for name, rec in files.items():
        _validate_file(name, rec, world, where)
    params = _dict(doc, "params", where, required=True)
    for fqn, e in params.items():
        if isinstance(e, dict) and "alias_of" in e:
            target = params.get(e["alias_of"])
            if not isinstance(target, dict) or "alias_of" in target:
                _fail(where, f"parameter {fqn!r} is an alias of {e['alias_of']!r}, which is not a stored parameter")
        else:
            validate_entry(e, f"{where}: parameter {fqn!r}", world, files, "model")
    for name, e in _dict(doc, "buffers", where, required=True).items():
        validate_entry(e, f"{where}: buffer {name!r}", world, files, "model")
    opts = doc.get("optimizers", [])
    if not isinstance(opts, list):
        _fail(where, "'optimizers' must be a list")
    for i, o in enumerate(opts):
        _validate_optimizer(o, i, world, files, where)
    if not isinstance(doc.get("extra", {}), dict):
        _fail(where, "'extra' must be an object")


def _dict(doc: dict, key: str, where: str, required: bool = False) -> dict:
    if required and key not in doc:
        _fail(where, f"{key!r} is missing (every save writes it: the manifest was damaged or not written by "
                     "fsdp_plugin)")
    v = doc.get(key, {})
    if not isinstance(v, dict):
        _fail(where, f"{key!r} must be an object")
    return v


def _validate_file(name: str, rec, world: int, where: str) -> None:
    m = _FILE_RE.match(name) if isinstance(name, str) else None
    if not m or int(m.group(1)) >= world:
        raise CheckpointError(f"{where}: file name {name!r} is not a rank file of this checkpoint "
                              "(refusing names that could leave the directory)")
    ok = (isinstance(rec, dict) and _is_int(rec.get("bytes")) and _is_int(rec.get("data_start"), 8)
          and _is_int(rec.get("block_bytes"), 1) and isinstance(rec.get("crc32"), list)
          and all(_is_int(c) and c < 2**32 for c in rec["crc32"]))
    if not ok:
        _fail(where, f"invalid record for file {name!r}")
    if len(rec["crc32"]) != -(-rec["bytes"] // rec["block_bytes"]):
        _fail(where, f"file {name!r}: {len(rec['crc32'])} CRC32 blocks for {rec['bytes']} bytes")


def validate_entry(e, what: str, world: int, files: dict, kind: str) -> None:
    """A stored tensor: known dtype, sane shape, pieces sorted/disjoint/covering, their files listed."""
    if not (isinstance(e, dict) and _format.known_dtype(e.get("dtype")) and isinstance(e.get("shape"), list)
            and all(_is_int(d) for d in e["shape"]) and isinstance(e.get("pieces"), list)):
        raise CorruptCheckpointError(f"{what}: invalid entry {str(e)[:200]}")
    n = _format.numel(e["shape"])
    if n > _format.MAX_NUMEL:
        raise CorruptCheckpointError(f"{what}: shape {e['shape']} is too large")
    if any(isinstance(p, list) and len(p) == 3 and isinstance(p[1], list) for p in e["pieces"]):
        _validate_boxes(e, what, world, files, kind)
        return
    pos = 0
    for p in e["pieces"]:
        if not (isinstance(p, list) and len(p) == 3 and all(_is_int(x) for x in p) and p[0] < world):
            raise CorruptCheckpointError(f"{what}: invalid piece {p!r}")
        if p[1] != pos or p[2] <= p[1]:
            raise CorruptCheckpointError(f"{what}: pieces overlap or leave elements {pos}.. uncovered (piece {p})")
        if file_name(p[0], kind) not in files:
            raise CorruptCheckpointError(f"{what}: piece {p} is in {file_name(p[0], kind)}, which is not listed")
        pos = p[2]
    if pos != n:
        raise CorruptCheckpointError(f"{what}: pieces cover {pos} of {n} elements")


def _validate_boxes(e: dict, what: str, world: int, files: dict, kind: str) -> None:
    for p in e["pieces"]:
        if not (isinstance(p, list) and len(p) == 3 and _is_int(p[0]) and p[0] < world and isinstance(p[1], list)):
            raise CorruptCheckpointError(f"{what}: invalid piece {p!r} (a tensor's pieces are all ranges or all boxes)")
        if file_name(p[0], kind) not in files:
            raise CorruptCheckpointError(f"{what}: piece {p} is in {file_name(p[0], kind)}, which is not listed")
    problem = boxes.check_boxes(e["pieces"], e["shape"])
    if problem is not None:
        raise CorruptCheckpointError(f"{what}: {problem}")
    starts = [boxes.piece_start(p, e["shape"]) for p in e["pieces"]]
    if starts != sorted(starts):
        raise CorruptCheckpointError(f"{what}: box pieces are not sorted by their first element")


def _validate_optimizer(o, i: int, world: int, files: dict, where: str) -> None:
    w = f"{where}: optimizer {i}"
    if not isinstance(o, dict) or not isinstance(o.get("param_groups"), list):
        _fail(w, "invalid entry")
    for g in o["param_groups"]:
        if not (isinstance(g, dict) and isinstance(g.get("params"), list)
                and all(isinstance(n, str) for n in g["params"])):
            _fail(w, "invalid param group")
    for fqn, states in _dict(o, "tensors", w).items():
        if not isinstance(states, dict):
            _fail(w, f"invalid state of {fqn!r}")
        for key, e in states.items():
            validate_entry(e, f"{w} state {fqn!r}[{key!r}]", world, files, "optim")
    for fqn, states in _dict(o, "scalars", w).items():
        if not isinstance(states, dict):
            _fail(w, f"invalid scalar state of {fqn!r}")
