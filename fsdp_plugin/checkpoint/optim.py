"""Optimizer state <-> checkpoint, keyed by parameter FQN (never by integer id).

A state value is *per-element* when it is a tensor shaped like the local parameter piece (``exp_avg``,
``momentum_buffer``...): it is sharded exactly like the parameter and stored in the optim rank files.
Every other tensor (``step``, ASGD's ``eta``...) and every non-tensor value is *scalar* state, stored in
the manifest through the JSON codec (tensors inline, bit-exact). ``param_groups`` keep their
hyper-parameters (codec-encoded) and list their parameters by FQN. Under the owner step (Adafactor, classes
marked per-tensor: ``fsdp_plugin/optim/owner_step.py``) a split parameter's state is whole on its owner:
a tensor of the full parameter's shape is written by the owner as the one piece ``[0, numel)``, anything
else as scalar state; per-element pieces loaded onto a split parameter are then gathered to its owner.
"""
from __future__ import annotations

import torch

from ..optim import owner_step
from .format import _format, codec, manifest
from .errors import CheckpointError, CheckpointMismatchError, MismatchReport

#: 0-d state keys of torch optimizers that are scalars even for a 0-d parameter.
_SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def as_list(optimizer) -> list:
    """``None`` -> [], one optimizer -> [it], a list/tuple -> list."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def is_per_element(key: str, value, param: torch.Tensor) -> bool:
    """Whether state ``key`` of ``param`` is sharded like the parameter (see module docstring)."""
    return isinstance(value, torch.Tensor) and is_per_element_shape(key, tuple(value.shape), tuple(param.shape))


def is_per_element_shape(key: str, value_shape: tuple, param_shape: tuple) -> bool:
    """:func:`is_per_element` from shapes alone (a foreign checkpoint's state, before it is read)."""
    return value_shape == param_shape and (len(param_shape) > 0 or key not in _SCALAR_KEYS)


def local_record(optimizers: list, shard_of: dict, opt_tensors: list) -> list[dict]:
    """Per optimizer: groups, this rank's per-element pieces and scalar state (JSON-able).

    ``shard_of`` maps ``id(param)`` to its ParamShard. Per-element tensors this rank writes are appended
    to ``opt_tensors`` as ``(key, tensor)``.
    """
    out = []
    for i, opt in enumerate(optimizers):
        groups, tensors, scalars = [], {}, {}
        for g in opt.param_groups:
            names = []
            for p in g["params"]:
                sh = shard_of.get(id(p))
                if sh is None:
                    raise CheckpointError(f"optimizer {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                                          "parameter of the model")
                names.append(sh.fqn)
                inline = owner_step.state_is_whole(opt, p)
                _record_state(i, sh, opt.state.get(p) or {}, tensors, scalars, opt_tensors, inline)
            hyper = {k: codec.encode(v, None, f"optimizer[{i}].param_groups.{k}") for k, v in g.items()
                     if k != "params"}
            groups.append({"params": names, **hyper})
        out.append({"class": f"{type(opt).__module__}.{type(opt).__qualname__}", "param_groups": groups,
                    "tensors": tensors, "scalars": scalars})
    return out


def owner_stepped(opt) -> bool:
    """Whether ``opt`` runs the owner step on a sharded model (its split parameters' state is whole)."""
    return owner_step.is_owner_stepped(opt)


def settle_loaded(opt, pairs: list, saved: dict) -> None:
    """Owner-stepped ``opt``: per-element pieces just loaded onto split parameters go whole to their owners."""
    tensors = saved.get("tensors", {})
    owner_step.settle_loaded(opt, {id(p): sorted(tensors.get(fqn, {})) for p, fqn in pairs})


def _record_state(i, sh, state: dict, tensors: dict, scalars: dict, opt_tensors: list, inline: bool) -> None:
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"optimizer {i}: state key {key!r} of {sh.fqn} is not a string")
        whole = inline and isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(sh.shape)
        if whole:   # owner step: the owner's whole tensor is the one piece [0, numel) (not inline JSON)
            if sh.writer:
                tensors.setdefault(sh.fqn, {})[key] = {"dtype": _format.dtype_name(value.dtype), "start": 0,
                                                       "end": value.numel(), "shape": list(sh.shape)}
                opt_tensors.append((manifest.tensor_key("optim", sh.fqn, i, key), value))
        elif not inline and is_per_element(key, value, sh.param):
            if sh.writer and sh.end > sh.start:
                tensors.setdefault(sh.fqn, {})[key] = {"dtype": _format.dtype_name(value.dtype), "start": sh.start, "end": sh.end,
                                                       "shape": list(sh.shape)}
                if sh.box is not None:      # a tensor-parallel piece: a box of the global tensor
                    tensors[sh.fqn][key]["box"] = [list(sh.box[0]), list(sh.box[1])]
                opt_tensors.append((manifest.tensor_key("optim", sh.fqn, i, key), value))
            elif sh.writer:
                tensors.setdefault(sh.fqn, {})[key] = {"dtype": _format.dtype_name(value.dtype), "start": 0, "end": 0,
                                                       "shape": list(sh.shape)}
        else:
            scalars.setdefault(sh.fqn, {})[key] = codec.encode(value, None, f"optimizer[{i}].state.{sh.fqn}.{key}")


# -- load ---------------------------------------------------------------------------------------------------
def match_groups(opt, saved: dict, i: int, names_of: dict, report: MismatchReport) -> list[tuple]:
    """Pair every current parameter of ``opt`` with its saved FQN (no side effects).

    Returns ``[(param, saved_fqn), ...]``. Unmatched names go into ``report`` (prefixed ``optimizer[i].``).
    """
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointMismatchError(f"optimizer {i} has {len(opt.param_groups)} param groups; the checkpoint has "
                                      f"{len(groups)}")
    pairs = []
    for j, (g, sg) in enumerate(zip(opt.param_groups, groups)):
        saved_names = set(sg["params"])
        used = set()
        for p in g["params"]:
            hit = next((n for n in names_of.get(id(p), ()) if n in saved_names), None)
            if hit is None:
                report.missing.append(f"optimizer[{i}].{names_of.get(id(p), ('?',))[0]}")
            else:
                pairs.append((p, hit))
                used.add(hit)
        report.unexpected += [f"optimizer[{i}].{n}" for n in sg["params"] if n not in used]
    return pairs


def apply_hyperparameters(opt, saved: dict, i: int) -> None:
    """Set every saved hyper-parameter of every param group (groups matched by index)."""
    for j, (g, sg) in enumerate(zip(opt.param_groups, saved["param_groups"])):
        for k, v in sg.items():
            if k != "params":
                g[k] = codec.decode(v, None, f"optimizer[{i}].param_groups[{j}].{k}")


def restore_scalars(opt, pairs: list[tuple], saved: dict, i: int) -> None:
    """Set every saved scalar state value (copying into an existing tensor to keep its device)."""
    scalars = saved.get("scalars", {})
    for p, fqn in pairs:
        for key, node in scalars.get(fqn, {}).items():
            set_scalar(opt, p, key, codec.decode(node, None, f"optimizer[{i}].state.{fqn}.{key}"))


def set_scalar(opt, p: torch.Tensor, key: str, value) -> None:
    """Set scalar state ``key`` of ``p`` (copying into an existing tensor of that shape, keeping its device)."""
    st = opt.state[p]
    old = st.get(key)
    if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == value.shape:
        old.copy_(value)
    else:
        st[key] = value.to(p.device) if isinstance(value, torch.Tensor) and _on_device(opt, p) else value


def _on_device(opt, p) -> bool:
    """Whether a fresh scalar tensor must live on the parameter's device (capturable/fused optimizers)."""
    for g in opt.param_groups:
        if any(q is p for q in g["params"]):
            return bool(g.get("capturable") or g.get("fused"))
    return False


def state_dest(opt, p: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The state tensor to load ``key`` of ``p`` into: the existing one if it fits, else a new one."""
    st = opt.state[p]
    old = st.get(key)
    if isinstance(old, torch.Tensor) and old.shape == p.shape and old.dtype == dtype:
        return old
    new = torch.zeros_like(p.detach(), dtype=dtype, memory_format=torch.contiguous_format)
    st[key] = new
    return new
