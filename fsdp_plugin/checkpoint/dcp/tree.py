"""The nested state dict of one or more DCP checkpoints, and which parts are the model and optimizers.

DCP flattens ``{"model": {...}, "optimizer": {...}, ...}`` into dotted keys and records each key's path
(``planner_data``); FQNs keep their dots inside one path element, so keys are never split on ``.``.
:func:`split` finds the model (``model``, Lightning's ``state_dict``, or torchtitan's top-level FQNs) and
the optimizers (``optimizer``, ``optimizer_<i>``); everything else is the trainer's ``extra``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import CheckpointStateError
from .metadata import DcpMetadata, TensorEntry

_MODEL_KEYS = ("model", "state_dict", "module")
_OPTIM_KEY = re.compile(r"^(optimizer|optim)(_(\d+))?$")


@dataclass
class Parts:
    """``model``: FQN -> entry; ``optimizers``: ``[{"state": {fqn: {key: entry}}, "param_groups": ...}]``
    (nested as saved); ``extra``: the rest, nested (leaves are entries)."""

    model: dict
    optimizers: list
    extra: dict = field(default_factory=dict)


def nest(mds: list[DcpMetadata]) -> dict:
    """One nested dict of every source's entries, keyed by their saved paths."""
    root: dict = {}
    for md in mds:
        for key, entry in md.entries.items():
            node = root
            path = md.paths[key]
            for p in path[:-1]:
                nxt = node.setdefault(p, {})
                if not isinstance(nxt, dict):
                    raise CheckpointStateError(f"{md.directory}: key {key!r} collides with another entry")
                node = nxt
            node[path[-1]] = entry
    return root


def split(root: dict) -> Parts:
    """Separate the model, the optimizers (in index order) and the rest (see module docstring)."""
    rest = dict(root)
    optims = sorted((k for k in root if isinstance(k, str) and _OPTIM_KEY.match(k) and isinstance(root[k], dict)),
                    key=lambda k: int(_OPTIM_KEY.match(k).group(3) or 0))
    optimizers = [rest.pop(k) for k in optims]
    model_key = next((k for k in _MODEL_KEYS if isinstance(root.get(k), dict)), None)
    if model_key is not None:
        model = _flat_fqns(rest.pop(model_key))
    else:  # torchtitan: model FQNs at the top level, next to the other states
        model = {k: v for k, v in rest.items() if isinstance(v, TensorEntry)}
        for k in model:
            del rest[k]
    return Parts(model, optimizers, rest)


def _flat_fqns(node: dict, prefix: str = "") -> dict:
    """A model state dict saved nested (``flatten_state_dict=False`` or a submodule dict) as FQN -> entry."""
    out = {}
    for k, v in node.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_fqns(v, name + "."))
        else:
            out[name] = v
    return out


def nest_optimizer(saved: dict, fqns: set[str]) -> tuple[dict, list[str]]:
    """``StateDictOptions(flatten_optimizer_state_dict=True)`` (torchtitan) saves ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<hp>`` as single path elements: split them with the model's FQNs (longest match, as
    FQNs hold dots) into the nested form. Returns ``(nested, keys naming no known parameter)``."""
    if not any(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in saved):
        return saved, []
    out: dict = {k: v for k, v in saved.items() if k in ("state", "param_groups")}
    unknown = []
    for key, entry in saved.items():
        section, _, rest = key.partition(".") if isinstance(key, str) else ("", "", "")
        if section not in ("state", "param_groups") or not rest:
            continue
        fqn = max((f for f in fqns if rest.startswith(f + ".")), key=len, default=None)
        if fqn is None:
            unknown.append(key)
            continue
        out.setdefault(section, {}).setdefault(fqn, {})[rest[len(fqn) + 1:]] = entry
    return out, unknown
