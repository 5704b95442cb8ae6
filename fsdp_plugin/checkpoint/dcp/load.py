"""Load torch DCP checkpoints into a sharded (or plain) model and its optimizers, at any world size.

Every rank reads only the byte ranges of its own pieces (:mod:`.reading`); optimizer tensors shaped like
their parameter are sharded like it, other state (Adam's ``step``) and ``param_groups`` hyper-parameters
are read whole. Parameters are matched by FQN, never by position. Collective: every rank raises together.
"""
from __future__ import annotations

import warnings

import torch

from ..storage import resolve
from .._finish import finish_load
from .. import _comm, _model, optim
from ..errors import (
    CheckpointMismatchError,
    MismatchReport,
    UnsafeCheckpointError,
)
from . import tree
from .metadata import BytesEntry, TensorEntry, read_metadata
from .reading import DcpReader


@_comm.uses_model_deadline
def load_dcp(path, model, optimizer=None, strict: bool = True, *, optimizer_path=None,
             report: MismatchReport | None = None):
    """Load DCP directory ``path`` (and ``optimizer_path``, where the optimizer was saved apart, as
    accelerate does) into ``model`` and ``optimizer`` (one or a list); return the other saved entries as a
    nested dict (tensors as CPU tensors, values that need a global skipped with a warning).

    ``strict`` as in :func:`fsdp_plugin.checkpoint.load_checkpoint`: names are checked before anything is
    read. Collective over the default process group.
    """
    err, extra = None, None
    try:
        dirs = [resolve(path, "load_dcp")] + ([resolve(optimizer_path, "load_dcp")]
                                              if optimizer_path is not None else [])
        parts = tree.split(tree.nest([read_metadata(d) for d in dirs]))
        extra = _load_local(parts, dirs[0], model, optim.as_list(optimizer), strict, report)
    except Exception as e:  # noqa: BLE001 - every rank must raise together
        err = e
    _comm.raise_if_any_failed(err)
    return extra


def _load_local(parts: tree.Parts, path: str, model, optimizers: list, strict: bool, out_report):
    report = MismatchReport()
    shards = _model.param_shards(model, boxes=True)
    copy_back, finishers = [], []
    with DcpReader() as reader:
        # Phase 1 only matches names (no side effects); phase 2 queues reads and creates optimizer state.
        actions = _match_model(parts.model, shards, _model.persistent_buffers(model), report)
        actions += _match_optimizers(reader, parts.optimizers, shards, optimizers, report, strict)
        if report and strict:
            raise CheckpointMismatchError(f"{path} does not match the model: {report.describe()} "
                                          "(pass strict=False to load the intersection)", report)
        for act in actions:
            act(reader, copy_back, finishers)
        extra = _queue_extra(reader, parts.extra, "")
        reader.execute()
    finish_load(path, copy_back, finishers, report, out_report)
    return _resolve(extra)


def _read_into(entry: TensorEntry, target: torch.Tensor, start: int, what: str, sh=None):
    """An action queuing elements ``[start, start + target.numel())`` of ``entry`` into ``target`` (or, given
    the parameter's piece ``sh``, the runs it holds: a tensor-parallel box)."""

    def act(reader, copy_back, finishers):
        dest, tmp = _model.flat_dest(target)
        if tmp is not None:
            copy_back.append((target.detach(), tmp))
        if sh is not None and sh.box is not None:
            reader.queue_runs(entry, _model.piece_runs(sh), dest, what)
        else:
            reader.queue(entry, start, dest, what)

    return act


def _check_shape(entry, shape, name: str, report: MismatchReport) -> bool:
    if not isinstance(entry, TensorEntry):
        report.mismatched[name] = "checkpoint holds a non-tensor value"
        return False
    if tuple(entry.size) != tuple(shape):
        report.mismatched[name] = f"checkpoint {list(entry.size)} vs model {list(shape)}"
        return False
    return True


def _match_model(saved: dict, shards, buffers, report: MismatchReport) -> list:
    actions, known = [], set()
    for sh in shards:
        names = (sh.fqn, *sh.aliases)
        known.update(names)
        hit = next((n for n in names if n in saved), None)
        if hit is None:
            report.missing.append(sh.fqn)
        elif _check_shape(saved[hit], sh.shape, sh.fqn, report):
            actions.append(_read_into(saved[hit], sh.param, sh.start, sh.fqn, sh))
    for name, buf in buffers:
        known.add(name)
        if name not in saved:
            report.missing.append(name)
        elif _check_shape(saved[name], buf.shape, name, report):
            actions.append(_read_into(saved[name], buf, 0, name))
    report.unexpected += [n for n in saved if n not in known]
    return actions


def _match_optimizers(reader, saved_opts: list, shards, optimizers: list, report: MismatchReport,
                      strict: bool) -> list:
    if optimizers and len(saved_opts) != len(optimizers):
        if strict:
            raise CheckpointMismatchError(f"the checkpoint holds {len(saved_opts)} optimizer(s); "
                                          f"{len(optimizers)} given (pass optimizer=None to load the weights only)")
        report.missing += [f"optimizer[{i}]" for i in range(len(saved_opts), len(optimizers))]
        report.unexpected += [f"optimizer[{i}]" for i in range(len(optimizers), len(saved_opts))]
    shard_of = {id(sh.param): sh for sh in shards}
    fqns = {n for sh in shards for n in (sh.fqn, *sh.aliases)}
    actions = []
    for i, (opt, saved) in enumerate(zip(optimizers, saved_opts)):
        saved, unknown = tree.nest_optimizer(saved, fqns)
        report.unexpected += [f"optimizer[{i}].{k}" for k in unknown]
        state = saved.get("state", {})
        pairs = _pair_params(opt, state, shard_of, i)
        _check_groups(reader, opt, saved.get("param_groups", {}), shard_of, i, report)
        actions.append(_hyperparameters(opt, saved.get("param_groups", {}), shard_of, i))
        for p, fqn in pairs:
            sh = shard_of[id(p)]
            for key, entry in state.get(fqn, {}).items():
                actions.append(_state_action(opt, p, sh, key, entry, f"optimizer[{i}].{fqn}.{key}", report))
    return actions


def _pair_params(opt, state: dict, shard_of: dict, i: int) -> list[tuple]:
    """``[(param, saved fqn)]`` for every parameter of ``opt`` with saved state (a parameter without any
    keeps none, as torch's own ``load_state_dict`` does)."""
    saved_names = set(state)
    pairs = []
    for g in opt.param_groups:
        for p in g["params"]:
            sh = shard_of.get(id(p))
            if sh is None:
                raise CheckpointMismatchError(f"optimizer {i} holds a tensor that is not a parameter of the model")
            hit = next((n for n in (sh.fqn, *sh.aliases) if n in saved_names), None)
            if hit is not None:
                pairs.append((p, hit))
    return pairs


def _state_action(opt, p, sh, key: str, entry, what: str, report: MismatchReport):
    """Read one saved state value: sharded like the parameter when per-element, else whole."""
    if isinstance(entry, TensorEntry) and optim.is_per_element_shape(key, tuple(entry.size), tuple(sh.shape)):
        def act(reader, copy_back, finishers):
            dest = optim.state_dest(opt, p, key, entry.dtype)
            _read_into(entry, dest, sh.start, what, sh)(reader, copy_back, finishers)
        return act

    def act_scalar(reader, copy_back, finishers):
        value = reader.whole(entry, what) if isinstance(entry, TensorEntry) else reader.value(entry, what)
        finishers.append(lambda: optim.set_scalar(opt, p, key, value))
    if isinstance(entry, dict):
        report.mismatched[what] = "checkpoint holds a nested value"
        return lambda *a: None
    return act_scalar


def _hyperparameters(opt, groups, shard_of: dict, i: int):
    """Set every saved hyper-parameter of each param group: ``param_groups.<j>.<hp>`` (matched by index) or
    the flattened ``param_groups.<fqn>.<hp>`` (taken from the group's first named parameter)."""

    def act(reader, copy_back, finishers):
        if not isinstance(groups, dict) or not groups:
            return
        indexed = all(isinstance(k, int) for k in groups)
        for j, g in enumerate(opt.param_groups):
            saved = groups.get(j) if indexed else _group_of(g, groups, shard_of)
            for hp, entry in (saved or {}).items():
                if hp != "params" and isinstance(entry, BytesEntry):
                    g[hp] = reader.value(entry, f"optimizer[{i}].param_groups[{j}].{hp}")
    return act


def _check_groups(reader, opt, groups, shard_of: dict, i: int, report: MismatchReport) -> None:
    """Saved param groups matched by index must hold the same parameters as ours (by FQN): otherwise
    hyper-parameters (weight decay, lr) would land on the wrong parameters."""
    if not (isinstance(groups, dict) and groups and all(isinstance(k, int) for k in groups)):
        return
    if len(groups) != len(opt.param_groups):
        raise CheckpointMismatchError(f"optimizer {i} has {len(opt.param_groups)} param groups; the checkpoint has "
                                      f"{len(groups)}: build the optimizer with the same groups as the saved run")
    for j, g in enumerate(opt.param_groups):
        entry = groups[j].get("params") if isinstance(groups[j], dict) else None
        if not isinstance(entry, BytesEntry):
            continue
        saved = reader.value(entry, f"optimizer[{i}].param_groups[{j}].params")
        saved = set(saved) if isinstance(saved, (list, tuple)) else set()
        ours = [shard_of[id(p)] for p in g["params"] if id(p) in shard_of]
        odd = [sh.fqn for sh in ours if not saved.intersection((sh.fqn, *sh.aliases))]
        if odd:
            report.mismatched[f"optimizer[{i}].param_groups[{j}]"] = (
                f"holds {', '.join(odd[:5])}, which the checkpoint's group {j} does not: build the param groups "
                "as the saved run did")


def _group_of(group: dict, groups: dict, shard_of: dict):
    for p in group["params"]:
        sh = shard_of.get(id(p))
        for n in (sh.fqn, *sh.aliases) if sh else ():
            if n in groups:
                return groups[n]
    return None


def _queue_extra(reader: DcpReader, node, where: str):
    """The non-model, non-optimizer entries: tensors queued whole, values read (unsafe ones skipped)."""
    if isinstance(node, dict):
        return {k: _queue_extra(reader, v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
    if isinstance(node, TensorEntry):
        return reader.whole(node, where)
    try:
        return reader.value(node, where)
    except UnsafeCheckpointError as e:
        warnings.warn(f"skipped {where!r} of the DCP checkpoint: {e}")
        return _SKIPPED


_SKIPPED = object()


def _resolve(node):
    if isinstance(node, dict):
        return {k: _resolve(v) for k, v in node.items() if v is not _SKIPPED}
    return node
