"""Pickle-free codec for Lightning's non-tensor checkpoint state: strict JSON plus a flat tensor dict.

``encode(obj)`` returns ``(tree, tensors)``: ``tree`` is standard JSON (``json.dumps(tree,
allow_nan=False)`` works) and ``tensors`` maps short generated keys (``"t0"``, ``"t1"``, ...) to
contiguous CPU tensors that safetensors can store. ``decode(tree, tensors)`` rebuilds the object.

Handled beyond plain JSON:

* the same tensor object under several keys (ModelCheckpoint's ``best_model_score`` and
  ``best_k_models``): stored once and decoded as one shared object;
* non-finite floats (``ReduceLROnPlateau.best = inf``), tuples (Adam ``betas``), non-str dict keys
  (optimizer ``state[0]``), ``torch.dtype``, ``torch.device``, ``torch.Size``, ``pathlib.Path``,
  ``argparse.Namespace``, sets, numpy scalars (stored as Python numbers).

Anything else raises :class:`CodecError` (a ``TypeError``) naming the key path, so that every rank fails
with the same message *before* any collective. Decoding never imports or executes anything.
"""
from __future__ import annotations

import argparse
import math
import pathlib
from typing import Any

import torch

__all__ = ["CodecError", "decode", "encode"]

_TAGS = frozenset(
    {"__tensor__", "__float__", "__tuple__", "__dict__", "__dtype__", "__device__", "__size__",
     "__path__", "__namespace__", "__set__"}
)
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class CodecError(TypeError):
    """A value that the pickle-free checkpoint codec cannot store."""


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Encode ``obj`` into a strict-JSON tree and a dict of tensors (deduplicated by identity)."""
    enc = _Encoder()
    tree = enc.enc(obj, "")
    return tree, enc.tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`encode`. ``tensors`` are the ones ``encode`` returned (e.g. read back from safetensors)."""
    return _Decoder(tensors or {}).dec(tree)


class _Encoder:
    """Walks an object tree; remembers tensors by ``id`` so that shared tensors are stored once."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._ids: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []  # keep encoded tensors alive so that ids stay unique

    def enc(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
        if isinstance(obj, torch.Tensor):
            return {"__tensor__": self._tensor_key(obj)}
        if isinstance(obj, dict):
            return self._dict(obj, path)
        if isinstance(obj, list):
            return [self.enc(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return self._other(obj, path)

    def _tensor_key(self, t: torch.Tensor) -> str:
        key = self._ids.get(id(t))
        if key is None:
            key = f"t{len(self.tensors)}"
            self._ids[id(t)] = key
            self._keep.append(t)
            self.tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        return key

    def _dict(self, obj: dict, path: str) -> Any:
        plain = all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS)
        if plain:
            return {k: self.enc(v, _join(path, k)) for k, v in obj.items()}
        return {"__dict__": [[self.enc(k, f"{path}<key>"), self.enc(v, _join(path, repr(k)))] for k, v in obj.items()]}

    def _other(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.enc(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            return {"__set__": [self.enc(v, f"{path}{{}}") for v in sorted(obj, key=repr)]}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, pathlib.PurePath):
            return {"__path__": str(obj)}
        if isinstance(obj, argparse.Namespace):
            return {"__namespace__": self._dict(vars(obj), path)}
        if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
            return self.enc(obj.item(), path)
        raise CodecError(
            f"checkpoint key {path or '<root>'!r}: a value of type {type(obj).__module__}.{type(obj).__qualname__} "
            "cannot be stored by fsdp_plugin's pickle-free checkpoint format. Store only JSON values, tensors, "
            "tuples, dtypes, devices and paths there (for hyper-parameters: "
            "`self.save_hyperparameters(ignore=[...])`, or pass a JSON-able value)."
        )


class _Decoder:
    """Rebuilds objects from an encoded tree; a tensor key decodes to one shared object."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def dec(self, tree: Any) -> Any:
        if isinstance(tree, list):
            return [self.dec(v) for v in tree]
        if not isinstance(tree, dict):
            return tree
        if len(tree) == 1:
            (tag, val), = tree.items()
            if tag in _TAGS:
                return self._tagged(tag, val)
        return {k: self.dec(v) for k, v in tree.items()}

    def _tagged(self, tag: str, val: Any) -> Any:
        if tag == "__tensor__":
            if val not in self.tensors:
                raise KeyError(f"checkpoint metadata refers to tensor {val!r}, which the checkpoint does not hold")
            return self.tensors[val]
        if tag == "__float__":
            return float(val)
        if tag == "__tuple__":
            return tuple(self.dec(v) for v in val)
        if tag == "__dict__":
            return {_hashable(self.dec(k)): self.dec(v) for k, v in val}
        if tag == "__set__":
            return {self.dec(v) for v in val}
        if tag == "__dtype__":
            return _DTYPES[val]
        if tag == "__device__":
            return torch.device(val)
        if tag == "__size__":
            return torch.Size(val)
        if tag == "__path__":
            return pathlib.Path(val)
        return argparse.Namespace(**self.dec(val))  # "__namespace__"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key
