"""Hugging Face safetensors interop for sharded models.

* :func:`load_pretrained` reads ``model.safetensors`` or the shards listed by
  ``model.safetensors.index.json``: every rank reads only the byte range of each tensor that its local
  piece covers (one contiguous range per tensor, cast through a bounded bounce buffer when the dtypes
  differ), straight into the local shard. No mmap, no full copy, no pickle.
* :func:`save_pretrained` writes HF safetensors + index without any gather: rank 0 creates the files
  at their final size, every rank ``pwrite``\\ s its own pieces at precomputed offsets (a tensor-parallel
  box one run per row it does not span whole), rank 0 publishes (fsync, rename, index last). The output
  directory must be visible to all ranks (shared filesystem).
* transformers models: names follow transformers' own conversion mapping (:mod:`.hf_convert`) both ways;
  renamed tensors and fused experts keep the ranged reads/writes above, any other converted tensor is read
  whole (load) or gathered whole on rank 0 (save).
"""
from __future__ import annotations

import copy
import os
import uuid

import torch

from ... import _progress
from ..._comm import failure
from .. import _comm, _model
from ..format import _format
from . import hf_convert
from ..errors import CheckpointError, CheckpointMismatchError, MismatchReport
from ..storage.fsio import byte_view, check_plain_name, close_file, file_size, open_in_dir, preadv_all
from .hf_gather import gather_full, gather_write, piece_table, write_runs
from .hf_out import INDEX_NAME, HFWriter
from ..storage import is_url, join, require_local, resolve, storage_for
from ..format.reader import ReadPlan
from ..format.writer import flat_cpu
from ..._flat.packed import refuse_export, refuse_load
from ...errors import ShardingError
from . import peft_names, quantized

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
        _load_local(model, resolve(path, "load_pretrained"), strict, report)  # a local path or a URL
    except Exception as e:  # noqa: BLE001 - every rank raises together
        err = e
    _comm.raise_if_any_failed(err)
    return report


def _load_local(model, path: str, strict: bool, report: MismatchReport) -> None:
    if getattr(model, "_fp_root", None) is None and any(hasattr(p, "_fp_handle") for p in model.parameters()):
        raise CheckpointError(
            f"fp.load_pretrained got a submodule ({type(model).__name__}) of a sharded model: its parameters hold "
            "this rank's shard pieces, which only the module fp.shard was called on describes. Pass that module "
            "(e.g. the LightningModule, not its self.model; a PEFT model inside it is matched by its base names)")
    directory, files = _resolve(path)
    with ReadPlan(directory, None, allowed_roots=_allowed_roots(directory)) as plan:
        stored = {}
        for f in files:
            for name, e in plan.header(f).entries.items():
                stored[name] = (f, e)
        refuse_load(model, stored, path)    # quantized checkpoints, 8-bit weights (``_flat/packed.py``)
        reads, converted, quantize = _match(model, stored, report)
        if report and strict:
            raise CheckpointMismatchError(f"{path} does not match the model: {report.describe()} "
                                          "(pass strict=False to load the intersection)", report)
        copy_back = []
        for target, start, parts in reads:
            dest, tmp = _model.flat_dest(target)
            if tmp is not None:
                copy_back.append((target.detach(), tmp))
            for (f, e), src_start, lo, hi in parts:
                src = _format.to_dtype(e.dtype)
                plan.add(f, e.begin + src_start * src.itemsize, src, dest[lo:hi], e.name)
        plan.progress = _load_progress(path, stored)
        plan.execute()
        plan.progress = None  # converted groups below are read as they are converted
        for group, targets in converted:
            _load_group(model, plan, stored, group, targets)
        quantized.load(plan, quantize)   # 4-bit weights: each rank quantizes its own piece (``quantized.py``)
    for dst, src in copy_back:
        dst.copy_(src)


def _load_progress(path: str, stored: dict):
    """Rank 0's progress lines (``FSDP_PLUGIN_LOG=INFO``) for a large load: the bytes this rank reads."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return _progress.logged(f"load_pretrained {path}", sum(e.end - e.begin for _, e in stored.values()))


def _load_group(model, plan: ReadPlan, stored: dict, group, targets: list) -> None:
    """A converted group (e.g. per-expert tensors fused into one): its sources are read whole, converted by
    transformers' converter, and each target keeps its own slice. Ranks holding no element of it read nothing."""
    if not any(t.numel() for t, *_ in targets):
        return
    full = {}
    for _, name in group.sources:
        f, e = stored[name]
        src = _format.to_dtype(e.dtype)
        full[name] = torch.empty(tuple(e.shape), dtype=src)
        plan.add(f, e.begin, src, full[name].view(-1), name)
    plan.execute()
    outs = hf_convert.run(model, group, full)
    del full
    for target, name, start, box in targets:
        if not target.numel():
            continue
        dest, tmp = _model.flat_dest(target)
        full = outs[name].reshape(-1)
        if box is None:
            dest.copy_(full[start:start + dest.numel()])
        else:     # a box of the global tensor (tensor or expert parallel): its runs, in the piece's order
            from ..format.boxes import box_runs
            dest.copy_(torch.cat([full[a:a + n] for a, n in box_runs(tuple(outs[name].shape), *box)]))
        if tmp is not None:
            target.detach().copy_(tmp)


def _match(model, stored: dict, report: MismatchReport) -> tuple[list, list, list]:
    """Plan what to read. ``reads``: ``(tensor, start, [((file, entry), source_start, lo, hi)])``, ranged
    reads of stored elements into ``tensor``'s local piece ``[lo, hi)`` (one-to-one names, and converted
    tensors whose layout is known); ``converted``: ``(group, [(tensor, name, start, box)])``, read whole;
    ``quantize``: ``(param, start, end, (file, entry))``, packed 4-bit weights quantized from the stored
    full-precision tensor (whose shape is the weight's ``quant_state.shape``)."""
    shards = _model.param_shards(model, boxes=True)
    fp_shapes = {id(sh.param): quantized.float_shape(sh.param) for sh in shards}
    ends = {id(sh.param): sh.end for sh in shards}
    peft = peft_names.prefixes(model)    # PEFT models: their base weights under the base checkpoint's names too
    targets = [((sh.fqn, *sh.aliases, *filter(None, [peft_names.base_name(sh.fqn, peft)])), sh.param,
                fp_shapes[id(sh.param)] or tuple(sh.shape), sh.start, sh.box) for sh in shards]
    targets += [((n,), b, tuple(b.shape), 0, None) for n, b in _model.persistent_buffers(model)]
    known = {n for names, *_ in targets for n in names}
    shapes = {n: (tuple(e.shape), _format.to_dtype(e.dtype)) for n, (_, e) in stored.items()}
    renames, groups = hf_convert.plan_load(model, shapes, known)
    by_output = {o: g for g in groups for o in g.outputs}
    layouts = {id(g): hf_convert.fused_layout(g, {n: s for n, (s, _) in shapes.items()}) for g in groups}
    reads, converted, quantize = [], {}, []
    for names, t, shape, start, box in targets:
        hit = next((n for n in names if n in renames or n in by_output), None)
        if hit is None:
            report.missing.append(names[0])
            continue
        g = by_output.get(hit) if hit not in renames else None
        have = tuple(stored[renames[hit]][1].shape) if g is None else g.outputs[hit]
        if tuple(have) != shape:
            report.mismatched[names[0]] = f"file {list(have)} vs model {list(shape)}"
        elif fp_shapes.get(id(t)) is not None:
            quantize.append((t, start, ends[id(t)], _quantize_source(names[0], stored, renames, hit, g, box)))
        elif g is None and box is not None:    # a tensor-parallel box: one ranged read per run
            reads.append((t, start, _box_parts(stored[renames[hit]], shape, box)))
        elif box is not None:     # a box of a converted tensor (per-expert HF keys into EP/TP boxes): read whole
            converted.setdefault(id(g), (g, []))[1].append((t, hit, start, box))
        elif g is None:
            reads.append((t, start, [(stored[renames[hit]], start, 0, t.numel())]))
        elif layouts[id(g)] is not None:
            parts = hf_convert.overlaps(layouts[id(g)], start, start + t.numel())
            reads.append((t, start, [(stored[n], s0, lo, hi) for n, s0, lo, hi in parts]))
        else:
            converted.setdefault(id(g), (g, []))[1].append((t, hit, start, None))
    unexpected = sorted([s for m, s in renames.items() if m not in known]
                        + [s for g in groups if not known.intersection(g.outputs) for _, s in g.sources])
    if peft:    # adapters are in no base checkpoint
        adapters = peft_names.adapter_params(model)
        report.missing[:] = [n for n in report.missing if n not in adapters]
    report.missing[:], unexpected = hf_convert.drop_ignored(model, report.missing, unexpected)
    report.unexpected += unexpected
    return reads, list(converted.values()), quantize


def _quantize_source(name: str, stored: dict, renames: dict, hit: str, group, box):
    """The stored tensor a packed 4-bit weight is quantized from: one-to-one names only (the ranged read of
    ``quantized.py``); a converted (fused) or tensor-parallel 4-bit weight is refused by name."""
    if group is not None or box is not None:
        raise ShardingError(
            f"fp.load_pretrained cannot quantize {name!r} into its 4-bit weight: it is "
            f"{'converted from several stored tensors' if group is not None else 'a tensor-parallel box'}, and "
            "only one-to-one names are quantized shard by shard. Load this model with transformers' "
            "from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)), then fp.shard")
    return stored[renames[hit]]


def _box_parts(source, shape: tuple, box: tuple) -> list:
    """``(source, stored_start, lo, hi)`` per run of ``box`` (offsets, sizes) of a tensor of ``shape``."""
    from ..format.boxes import box_runs
    parts, pos = [], 0
    for a, n in box_runs(shape, *box):
        parts.append((source, a, pos, pos + n))
        pos += n
    return parts


def _resolve(path: str) -> tuple[str, list[str]]:
    """(directory, safetensors file names) of an HF checkpoint at ``path`` (a local path or a URL)."""
    if is_url(path):
        return _resolve_remote(path)
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.lexists(os.path.join(path, INDEX_NAME)):
        return path, _read_index(path)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path, ["model.safetensors"]
    raise CheckpointError(f"{path} has neither model.safetensors nor {INDEX_NAME}")


def _resolve_remote(url: str) -> tuple[str, list[str]]:
    st = storage_for(url)
    if url.endswith(".safetensors") and st.size(url) is not None:
        parent, name = url.rsplit("/", 1)
        return parent, [name]
    if st.size(join(url, INDEX_NAME)) is not None:
        return url, _read_index(url)
    if st.size(join(url, "model.safetensors")) is not None:
        return url, ["model.safetensors"]
    raise CheckpointError(f"{url} has neither model.safetensors nor {INDEX_NAME}")


def _read_index(directory: str) -> list[str]:
    index = join(directory, INDEX_NAME)
    fd = open_in_dir(directory, INDEX_NAME, index, _allowed_roots(directory))
    try:
        size = file_size(fd)
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{index}: larger than {MAX_INDEX_BYTES} bytes; refusing to read it")
        raw = bytearray(size)
        preadv_all(fd, [memoryview(raw)], 0, index)
        doc = _format.strict_json_loads(bytes(raw), index)
    finally:
        close_file(fd)
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
    A transformers model is written the way its own ``save_pretrained`` writes it: names and tensors that
    transformers converts on load are converted back (fused experts split by ranges; other converted
    tensors gathered whole on rank 0, one group at a time), and ``config.json`` (+ ``generation_config.json``)
    are written, so ``from_pretrained(path)`` reads it back.
    """
    failure.refuse("fp.save_pretrained")
    if is_url(os.fspath(path)):  # rank 0 gathers into a local temporary directory, then uploads (hf_remote.py)
        from .hf_remote import save_pretrained_remote

        return save_pretrained_remote(save_pretrained, model, resolve(path, "save_pretrained"),
                                      max_shard_size=max_shard_size, dtype=dtype)
    path = require_local(path, "save_pretrained")
    refuse_export(model, "fp.save_pretrained")
    rank = _comm.rank()
    out = _SaveLayout(model, dtype)
    uid = _comm.broadcast_bytes(uuid.uuid4().hex.encode() if rank == 0 else None).decode()
    writer = HFWriter(path, out.entries, max_shard_size, uid)
    err = None
    if rank == 0:
        err = _attempt(writer.create)
    _comm.raise_if_any_failed(err)
    if gather is None:
        gather = not _comm.all_true(os.path.exists(writer.tmp_path(0)))
    err = _attempt(lambda: _write_all(writer, out, gather, dtype))
    try:
        _comm.raise_if_any_failed(err)
    except BaseException:
        if rank == 0:
            writer.abort()
        raise
    if rank == 0:
        err = _attempt(lambda: (writer.publish(), _write_config(model, path, out.saved_dtype)))
    _comm.raise_if_any_failed(err)


class _SaveLayout:
    """What goes into the files: ``entries`` = (name, dtype, shape) in file order. Shards in ``pieces`` are
    written piece by piece by whichever rank holds them (renamed, or split by a known fused layout into the
    per-expert tensors transformers writes); ``groups`` are converted by transformers after a gather."""

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype
        self.shards = _model.param_shards(model, boxes=True)
        self.buffers = _model.persistent_buffers(model)
        names = [sh.fqn for sh in self.shards] + [n for n, _ in self.buffers]
        self.renames, groups = hf_convert.plan_save(model, names)
        shapes = {sh.fqn: tuple(sh.shape) for sh in self.shards} | {n: tuple(b.shape) for n, b in self.buffers}
        dtypes = {sh.fqn: sh.dtype for sh in self.shards} | {n: b.dtype for n, b in self.buffers}
        self.layouts, self.groups, fused = {}, [], []
        self._load_transforms = hf_convert.load_transforms(model) if groups else None
        for g in groups:
            hf_convert.save_group_shapes(model, g, shapes, dtypes)
            layout = self._layout(g, set(names), dtypes)
            if layout is not None:
                self.layouts[g.sources[0][1]] = layout
                fused.append(g)
            else:
                self.groups.append(g)
        in_group = {n for g in self.groups for _, n in g.sources}
        boxed = next((sh.fqn for sh in self.shards if sh.box is not None and sh.fqn in in_group), None)
        if boxed is not None:
            raise CheckpointError(f"fp.save_pretrained: {boxed!r} is tensor-parallel and transformers converts it "
                                  "while saving (not a rename or a split of it): not supported; save with "
                                  "fp.save_checkpoint and export that with `fsdp-plugin consolidate CKPT OUT`")
        self.pieces = [sh for sh in self.shards if sh.fqn not in in_group]
        self.direct_buffers = [(n, b) for n, b in self.buffers if n not in in_group]
        self.entries = [(self.renames[sh.fqn], _out(sh.dtype, dtype), tuple(sh.shape))
                        for sh in self.pieces if sh.fqn in self.renames]
        self.entries += [(self.renames[n], _out(b.dtype, dtype), tuple(b.shape)) for n, b in self.direct_buffers]
        for g in fused + self.groups:
            gdtype = _out(dtypes[g.sources[0][1]], dtype)
            self.entries += [(n, gdtype, shape) for n, shape in g.outputs.items()]
        floating = [d for d in dtypes.values() if d.is_floating_point]
        self.saved_dtype = dtype or (floating[0] if floating else None)

    def _layout(self, g, names: set, dtypes: dict):
        """The fused layout of a one-parameter group, found by planning how transformers would load its outputs."""
        if len(g.sources) != 1:
            return None
        fqn = g.sources[0][1]
        _, back = hf_convert.plan_load(self.model, {n: (s, dtypes[fqn]) for n, s in g.outputs.items()}, names,
                                       self._load_transforms)
        if len(back) != 1 or set(back[0].outputs) != {fqn}:
            return None
        return hf_convert.fused_layout(back[0], g.outputs)

    def write_piece(self, writer: HFWriter, fqn: str, t: torch.Tensor, start: int) -> None:
        """Write elements ``[start, start + t.numel())`` of model tensor ``fqn`` where the files hold them."""
        layout = self.layouts.get(fqn)
        if layout is None:
            _write_tensor(writer, self.renames[fqn], t, start, self.dtype)
            return
        flat = t.detach().reshape(-1)
        for name, src_start, lo, hi in hf_convert.overlaps(layout, start, start + flat.numel()):
            _write_tensor(writer, name, flat[lo:hi], src_start, self.dtype)


def fused_runs(model) -> dict[str, list[tuple[int, str, int, int]]]:
    """``{output name: [(out_start, fqn, start, n), ...]}`` for the tensors transformers writes out of a fused
    parameter (per-expert tensors of ``experts.gate_up_proj``...), from the fused layouts of :class:`_SaveLayout`:
    elements ``[out_start, out_start + n)`` of the output are elements ``[start, start + n)`` of ``fqn``."""
    out = _SaveLayout(model, None)
    numel = {sh.fqn: sh.shape.numel() for sh in out.shards}
    runs: dict[str, list] = {}
    for fqn, layout in out.layouts.items():
        for name, out_start, lo, hi in hf_convert.overlaps(layout, 0, numel[fqn]):
            runs.setdefault(name, []).append((out_start, fqn, lo, hi - lo))
    return runs


def _out(t_dtype, dtype) -> str:
    return _format.dtype_name(_out_dtype(t_dtype, dtype))


def _write_all(writer: HFWriter, out: _SaveLayout, gather: bool, dtype) -> None:
    rank = _comm.rank()
    try:
        if gather:
            gather_write(writer, out.pieces, out.direct_buffers,
                         lambda name, t, start: out.write_piece(writer, name, t, start))
        else:
            for sh in out.pieces:     # a TP box is written run by run where the full tensor holds it
                if sh.writer and sh.end > sh.start:
                    write_runs(lambda name, t, start: out.write_piece(writer, name, t, start), sh.fqn,
                               sh.param.detach().reshape(-1), _model.piece_runs(sh))
            for name, buf in out.direct_buffers if rank == 0 else []:
                out.write_piece(writer, name, buf, 0)
        if out.groups:
            _write_groups(writer, out, dtype)
    finally:
        writer.sync_close()


def _write_groups(writer: HFWriter, out: _SaveLayout, dtype) -> None:
    """Tensors transformers converts back when saving: gathered whole on rank 0, converted, written there."""
    index = {sh.fqn: i for i, sh in enumerate(out.shards)}
    buffers = dict(out.buffers)
    table = piece_table(out.shards)
    for g in out.groups:
        full = {}
        for _, name in g.sources:
            full[name] = gather_full(out.shards[index[name]], index[name], table) if name in index else buffers[name]
        if _comm.rank() == 0:
            for name, t in hf_convert.run(out.model, g, full).items():
                _write_tensor(writer, name, t.contiguous(), 0, dtype)


def _write_config(model, path: str, saved_dtype) -> None:
    """``config.json`` (+ ``generation_config.json``) as transformers' ``save_pretrained`` writes them."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    if saved_dtype is not None:
        config.dtype = str(saved_dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)


def _attempt(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _out_dtype(t_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype


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

