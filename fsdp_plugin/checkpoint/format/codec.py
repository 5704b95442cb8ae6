"""The one JSON + tensor codec (no pickle): checkpoint ``extra``, optimizer hyper-parameters and scalar state,
Lightning's trainer state and accelerate's small states all go through it.

Plain JSON values pass through: dicts with str keys, lists, str, int, bool, None, finite floats (``repr``
round-trips exactly). Other supported values become tagged objects ``{"__type__": ...}``: tuple, set,
dict with non-str keys (or a key named ``__type__``), NaN/±inf, bytes, ``torch.dtype``,
``torch.device``, ``torch.Size``, ``pathlib.Path``, ``argparse.Namespace``, numpy scalars (as Python
numbers) and tensors. Tensors are handed to ``tensor_sink(key_path, tensor) -> node``: stored inline
(:func:`inline_tensor`, exact bytes as hex) or by reference into a safetensors file
(:func:`encode_state` / :func:`decode_state`: a flat ``{key: tensor}`` dict, shared tensors stored once
and decoded as one object). Anything else raises :class:`~fsdp_plugin.CodecError` (a ``TypeError``)
naming the key path, so every rank fails with the same message before any collective.
"""
from __future__ import annotations

import argparse
import math
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from . import _format
from ...errors import CodecError
from ..errors import CorruptCheckpointError
from ..storage.fsio import byte_view

TAG = "__type__"
#: Largest tensor stored inline in JSON (elements); bigger ones need a tensor file.
MAX_INLINE_NUMEL = 1 << 16


def inline_tensor(t: torch.Tensor) -> dict:
    """JSON node holding ``t`` exactly: dtype, shape and its raw little-endian bytes as hex."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() > MAX_INLINE_NUMEL:
        raise CodecError(f"tensor of {t.numel()} elements is too large to store inline in JSON")
    raw = bytes(byte_view(t.reshape(-1)))
    return {TAG: "tensor", "dtype": _format.dtype_name(t.dtype), "shape": list(t.shape), "hex": raw.hex()}


def tensor_from_inline(node: dict, where: str) -> torch.Tensor:
    """Inverse of :func:`inline_tensor`; validates dtype, shape and byte count."""
    try:
        dtype = _format.to_dtype(node["dtype"])
        shape = [int(d) for d in node["shape"]]
        raw = bytes.fromhex(node["hex"])
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"{where}: invalid inline tensor {str(node)[:200]}") from None
    if any(d < 0 for d in shape) or len(raw) != _format.numel(shape) * dtype.itemsize:
        raise CorruptCheckpointError(f"{where}: inline tensor bytes do not match dtype/shape")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


def encode(obj: Any, tensor_sink: Callable[[str, torch.Tensor], dict] | None = None, path: str = "") -> Any:
    """Encode ``obj`` into JSON-able values (see module docstring); ``path`` names the location in errors."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {TAG: "float", "value": repr(float(obj))}
    if isinstance(obj, torch.Tensor):
        sink = tensor_sink or (lambda _p, t: inline_tensor(t))
        return sink(path, obj)
    if isinstance(obj, torch.Size):
        return {TAG: "size", "items": list(obj)}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [encode(v, tensor_sink, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensor_sink, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return _encode_dict(obj, tensor_sink, path)
    return _encode_scalar_type(obj, path)


def _encode_dict(obj: dict, tensor_sink, path: str):
    if all(isinstance(k, str) for k in obj) and TAG not in obj:
        return {k: encode(v, tensor_sink, f"{path}.{k}" if path else k) for k, v in obj.items()}
    return {TAG: "dict", "items": [[encode(k, None, f"{path}<key>"), encode(v, tensor_sink, f"{path}[{k!r}]")]
                                   for k, v in obj.items()]}


def _encode_scalar_type(obj: Any, path: str):
    if isinstance(obj, torch.dtype):
        return {TAG: "dtype", "value": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {TAG: "device", "value": str(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return {TAG: "bytes", "hex": bytes(obj).hex()}
    if isinstance(obj, pathlib.PurePath):
        return {TAG: "path", "value": str(obj)}
    if isinstance(obj, argparse.Namespace):
        return {TAG: "namespace", "items": encode(vars(obj), None, path)}
    if isinstance(obj, (set, frozenset)):
        return {TAG: "set", "items": [encode(v, None, f"{path}{{}}") for v in sorted(obj, key=repr)]}
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "shape", None) == ():
        return encode(obj.item(), None, path)  # numpy scalars
    raise CodecError(f"checkpoint value at {path or '<root>'!r} has type {type(obj).__qualname__}, which cannot "
                    "be stored without pickle: make it JSON-able (dict/list/str/int/float/bool/None, tuples, "
                    "tensors) or give it a state_dict() of tensors and JSON values (Lightning hyper-parameters: "
                    "self.save_hyperparameters(ignore=[...]))")


def decode(node: Any, tensor_source: Callable[[dict, str], torch.Tensor] | None = None, path: str = "") -> Any:
    """Inverse of :func:`encode`. ``tensor_source(node, path)`` resolves tensor references."""
    if isinstance(node, list):
        return [decode(v, tensor_source, f"{path}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    tag = node.get(TAG)
    if tag is None:
        return {k: decode(v, tensor_source, f"{path}.{k}" if path else k) for k, v in node.items()}
    try:
        return _decode_tag(tag, node, tensor_source, path)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"invalid tagged value at {path or '<root>'!r}: {e}") from None


def _decode_tag(tag: str, node: dict, tensor_source, path: str):
    if tag == "tensor":
        return tensor_from_inline(node, path)
    if tag == "tensor_ref":
        if tensor_source is None:
            raise CorruptCheckpointError(f"tensor reference at {path!r} outside a checkpoint")
        return tensor_source(node, path)
    if tag == "tuple":
        return tuple(decode(v, tensor_source, f"{path}[{i}]") for i, v in enumerate(node["items"]))
    if tag == "dict":
        return {_hashable(decode(k, None, path)): decode(v, tensor_source, path) for k, v in node["items"]}
    if tag == "float":
        return float(node["value"])
    simple = {"size": lambda: torch.Size(node["items"]), "device": lambda: torch.device(node["value"]),
              "bytes": lambda: bytes.fromhex(node["hex"]), "path": lambda: pathlib.Path(node["value"]),
              "namespace": lambda: argparse.Namespace(**decode(node["items"], None, path)),
              "set": lambda: {_hashable(decode(v, None, path)) for v in node["items"]},
              "dtype": lambda: torch_dtype(node["value"])}
    if tag not in simple:
        raise CorruptCheckpointError(f"unknown tagged value {tag!r} at {path or '<root>'!r}")
    return simple[tag]()


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``: the name the codec stores); ``TypeError`` if none.

    Safetensors names (``"BF16"``) are :func:`fsdp_plugin.checkpoint.format._format.to_dtype`'s."""
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"unknown dtype {name!r}")
    return dt


def _hashable(k):
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def encode_state(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(tree, tensors)``: ``tree`` is strict JSON, ``tensors`` maps ``"t0", "t1"...`` to CPU copies (one per
    distinct tensor object, so safetensors can store them and shared tensors stay shared)."""
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[int, str] = {}
    keep: list[torch.Tensor] = []   # keeps ids unique while encoding

    def sink(_path: str, t: torch.Tensor) -> dict:
        key = keys.get(id(t))
        if key is None:
            key = keys[id(t)] = f"t{len(tensors)}"
            keep.append(t)
            tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        return {TAG: "tensor_ref", "key": key}

    return encode(obj, sink), tensors


def decode_state(tree: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """Inverse of :func:`encode_state`; every reference to one key decodes to the same tensor object."""
    tensors = tensors or {}

    def source(node: dict, where: str) -> torch.Tensor:
        if node.get("key") not in tensors:
            raise CorruptCheckpointError(f"state at {where!r} refers to tensor {node.get('key')!r}, which is not "
                                         "stored with it")
        return tensors[node["key"]]

    return decode(tree, source)
