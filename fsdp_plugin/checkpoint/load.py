"""``load_checkpoint``: each rank reads only the byte ranges overlapping its own pieces.

Any world size and strategy loads any checkpoint: a stored piece ``[r, a, b)`` and a local piece
``[start, end)`` are element ranges of the same flattened tensor, so their overlap is one contiguous
byte range in rank ``r``'s file and one contiguous slice of the local tensor. Tensor-parallel pieces are
boxes of the global tensor (:mod:`.boxes`): their overlap is a list of such ranges (one per run).
"""
from __future__ import annotations

import os

import torch

from ._finish import finish_load
from .asyncsave import _async
from . import _comm, _model, optim
from .format import _format, boxes, codec, layouts, manifest
from .errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    MismatchReport,
)
from .dcp.load import load_dcp  # imported now: its unpicklers subclass pickle's at import
from .format.reader import ReadPlan
from .storage import files_dir, join, resolve


@_comm.uses_model_deadline
def load_checkpoint(path, model, optimizer=None, strict: bool = True, *, report: MismatchReport | None = None):
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and optimizer(s)); return ``extra``.

    Collective over the default process group. ``strict=True`` raises :class:`CheckpointMismatchError`
    listing missing / unexpected / shape-mismatched names before touching anything; ``strict=False`` loads
    the intersection, warns (:class:`CheckpointMismatchWarning`) and fills ``report`` if given. Optimizer
    state is created when the optimizer has none yet. Dtypes are cast when model and checkpoint differ.
    A torch distributed checkpoint (DCP) directory is read too (:mod:`.dcp`): its other entries are returned.
    """
    _async.wait_pending()  # a pending asynchronous save may be writing this very path
    path = resolve(path, "load_checkpoint")
    if layouts.is_dcp_dir(path):  # torch's distributed checkpoint: its own reader
        return load_dcp(path, model, optimizer, strict, report=report)
    err, extra = None, None
    try:
        extra = _load_local(path, model, optim.as_list(optimizer), strict, report)
    except Exception as e:  # noqa: BLE001 - every rank must raise together
        err = e
    _comm.raise_if_any_failed(err)
    return extra


def _load_local(path, model, optimizers, strict, out_report):
    path = layouts.checkpoint_dir(path)  # also model_0/ of an accelerate state, fsdp_plugin_state/ of a Trainer's
    doc = manifest.read(path)
    report = MismatchReport()
    shards = _model.param_shards(model, boxes=True)
    # Phase 1 only matches names (no side effects); phase 2 queues reads and creates optimizer state.
    actions = _match_model(doc, shards, _model.persistent_buffers(model), report)
    opt_actions, finishers = _match_optimizers(path, doc, shards, optimizers, report, strict)
    if report and strict:
        raise CheckpointMismatchError(f"{path} does not match the model: {report.describe()} "
                                      "(pass strict=False to load the intersection)", report)
    copy_back = []
    with ReadPlan(files_dir(path, doc), doc["files"]) as plan:
        for act in actions + opt_actions:
            act(plan, copy_back)
        extra = _plan_extra(plan, doc, path)
        plan.execute()
    finish_load(path, copy_back, finishers, report, out_report)
    return extra


def _read_into(entry: dict, kind: str, key: str, target: torch.Tensor, start: int, what: str, box=None):
    """An action queuing the reads of a stored tensor's elements ``[start, ...)`` (or of the global box
    ``box``, a tensor-parallel piece) into ``target``."""

    def act(plan, copy_back):
        dest, tmp = _model.flat_dest(target)
        if tmp is not None:
            copy_back.append((target.detach(), tmp))
        add_reads(plan, entry, kind, key, dest, start, what, box)

    return act


def add_reads(plan: ReadPlan, entry: dict, kind: str, key: str, dest: torch.Tensor, start: int, what: str,
              box=None):
    """Queue reads of elements ``[start, start + dest.numel())`` of a stored tensor into 1-D ``dest`` (or,
    with ``box = (offsets, sizes)``, of that box of the global tensor, in its row-major order). Stored pieces
    may be ranges or boxes (:mod:`.boxes`): their runs are intersected with the destination's."""
    dst = boxes.box_runs(entry["shape"], *box) if box is not None else [(start, dest.numel())]
    lo_all, hi_all = (dst[0][0], dst[-1][0] + dst[-1][1]) if dst else (0, 0)
    dtype = _format.to_dtype(entry["dtype"])
    for piece in entry["pieces"]:
        if not boxes.is_box(piece) and (piece[2] <= lo_all or piece[1] >= hi_all):
            continue
        runs = boxes.piece_runs(piece, entry["shape"])
        hits = list(boxes.overlaps(runs, dst))
        if not hits:
            continue
        fname, n = manifest.file_name(piece[0], kind), boxes.piece_numel(piece)
        e = plan.header(fname).entries.get(key)
        if e is None or e.dtype != entry["dtype"] or e.shape != (n,):
            found = "missing" if e is None else f"{e.dtype} {list(e.shape)}"
            raise CorruptCheckpointError(f"{join(plan.directory, fname)}: tensor {key!r} is {found} in the "
                                         f"file header; manifest.json says {entry['dtype']} [{n}]")
        for so, do, k in hits:
            plan.add(fname, e.begin + so * dtype.itemsize, dtype, dest[do:do + k], what)


def _match_model(doc, shards, buffers, report) -> list:
    params, actions, known = doc["params"], [], set()
    for sh in shards:
        names = (sh.fqn, *sh.aliases)
        known.update(names)
        hit = next((n for n in names if n in params), None)
        if hit is None:
            report.missing.append(sh.fqn)
            continue
        stored = params[hit].get("alias_of", hit)
        entry = params[stored]
        if list(entry["shape"]) != list(sh.shape):
            report.mismatched[sh.fqn] = f"checkpoint {entry['shape']} vs model {list(sh.shape)}"
            continue
        actions.append(_read_into(entry, "model", stored, sh.param, sh.start, sh.fqn, sh.box))
    report.unexpected += [n for n in params if n not in known]
    saved, seen = doc["buffers"], set()
    for name, buf in buffers:
        seen.add(name)
        entry = saved.get(name)
        if entry is None:
            report.missing.append(name)
        elif list(entry["shape"]) != list(buf.shape):
            report.mismatched[name] = f"checkpoint {entry['shape']} vs model {list(buf.shape)}"
        else:
            actions.append(_read_into(entry, "model", name, buf, 0, name))
    report.unexpected += [n for n in saved if n not in seen]
    return actions


def _match_optimizers(path, doc, shards, optimizers, report, strict) -> tuple[list, list]:
    saved_opts = doc.get("optimizers", [])
    if optimizers and len(saved_opts) != len(optimizers):
        if strict:
            raise CheckpointMismatchError(f"{path} holds {len(saved_opts)} optimizer(s); {len(optimizers)} given")
        report.missing += [f"optimizer[{i}]" for i in range(len(saved_opts), len(optimizers))]
        report.unexpected += [f"optimizer[{i}]" for i in range(len(optimizers), len(saved_opts))]
    names_of = {id(sh.param): (sh.fqn, *sh.aliases) for sh in shards}
    shard_of = {id(sh.param): sh for sh in shards}
    actions, finishers = [], []
    for i, (opt, saved) in enumerate(zip(optimizers, saved_opts)):
        pairs = optim.match_groups(opt, saved, i, names_of, report)
        for p, fqn in pairs:
            sh = shard_of[id(p)]
            for key, entry in saved.get("tensors", {}).get(fqn, {}).items():
                what = f"optimizer[{i}].{fqn}.{key}"
                if list(entry["shape"]) != list(sh.shape):
                    report.mismatched[what] = f"checkpoint {entry['shape']} vs model {list(sh.shape)}"
                    continue
                actions.append(_opt_read(opt, p, key, entry, manifest.tensor_key("optim", fqn, i, key), sh, what))
        finishers.append(lambda opt=opt, pairs=pairs, saved=saved, i=i: _finish_optimizer(opt, pairs, saved, i))
    return actions, finishers


def _opt_read(opt, p, key, entry, file_key, sh, what):
    def act(plan, copy_back):
        dest = optim.state_dest(opt, p, key, _format.to_dtype(entry["dtype"]))
        _read_into(entry, "optim", file_key, dest, sh.start, what, sh.box)(plan, copy_back)

    return act


def _finish_optimizer(opt, pairs, saved, i) -> None:
    optim.apply_hyperparameters(opt, saved, i)
    optim.restore_scalars(opt, pairs, saved, i)
    if optim.owner_stepped(opt):
        optim.settle_loaded(opt, pairs, saved)


def _plan_extra(plan, doc, path=""):
    extras, me = doc.get("extra", {}), _comm.rank()
    src = str(me) if str(me) in extras else "0"
    if src not in extras:
        return None

    def source(node: dict, where: str) -> torch.Tensor:
        """Allocate an ``extra`` tensor (after checking the file header agrees) and queue its read."""
        shape = node.get("shape")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and _format.known_dtype(node.get("dtype")) and isinstance(node.get("key"), str)):
            raise CorruptCheckpointError(f"{path}: invalid tensor reference at {where!r}")
        n = _format.numel(shape)
        entry = {"dtype": node["dtype"], "shape": shape, "pieces": [[int(src), 0, n]] if n else []}
        if n:  # check the file header agrees before allocating anything
            fname = manifest.file_name(int(src), "extra")
            e = plan.header(fname).entries.get(node["key"])
            if e is None or e.dtype != node["dtype"] or e.shape != (n,):
                raise CorruptCheckpointError(f"{os.path.join(path, fname)}: tensor {node['key']!r} does not match "
                                             f"manifest.json ({node['dtype']} {shape})")
        t = torch.empty(shape, dtype=_format.to_dtype(node["dtype"]))
        if n:
            add_reads(plan, entry, "extra", node["key"], t.view(-1), 0, f"extra {where}")
        return t

    return codec.decode(extras[src], source, "extra")
