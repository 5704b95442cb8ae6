"""Read-only decoder for Lightning state written by fsdp_plugin's first release (tags ``__tuple__``,
``__tensor__``...; full files with base64 inline tensors). Saves use :mod:`fsdp_plugin.checkpoint.format.codec`;
this module only keeps those older checkpoints loadable instead of decoding their tags as plain dicts."""
from __future__ import annotations

import argparse
import base64
import pathlib
from typing import Any

import torch

from fsdp_plugin.checkpoint.format.codec import torch_dtype
from fsdp_plugin.checkpoint.errors import CheckpointStateError

TAGS = frozenset({"__tensor__", "__float__", "__tuple__", "__dict__", "__dtype__", "__device__", "__size__",
                  "__path__", "__namespace__", "__set__"})


def is_v1(tree: Any) -> bool:
    """Whether ``tree`` uses the first release's tags anywhere (one-key dicts whose key is a v1 tag)."""
    if isinstance(tree, list):
        return any(is_v1(v) for v in tree)
    if not isinstance(tree, dict):
        return False
    if len(tree) == 1 and next(iter(tree)) in TAGS:
        return True
    return any(is_v1(v) for v in tree.values())


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The object the first release encoded as ``(tree, tensors)``."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1 and next(iter(tree)) in TAGS:
        (tag, val), = tree.items()
        return _tagged(tag, val, tensors)
    return {k: decode(v, tensors) for k, v in tree.items()}


def _tagged(tag: str, val: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if tag == "__tensor__":
        if val not in tensors:
            raise CheckpointStateError(f"checkpoint metadata refers to tensor {val!r}, which the checkpoint does "
                                       "not hold")
        return tensors[val]
    simple = {"__float__": float, "__dtype__": torch_dtype, "__device__": torch.device,
              "__size__": torch.Size, "__path__": pathlib.Path}
    if tag in simple:
        return simple[tag](val)
    if tag == "__tuple__":
        return tuple(decode(v, tensors) for v in val)
    if tag == "__set__":
        return {decode(v, tensors) for v in val}
    if tag == "__dict__":
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in val}
    return argparse.Namespace(**decode(val, tensors))  # "__namespace__"


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def b64_tensor(node: dict) -> torch.Tensor:
    """A first-release inline tensor (``{"dtype", "shape", "b64"}``) of a ``full`` file's header."""
    raw = bytearray(base64.b64decode(node["b64"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(torch_dtype(node["dtype"])).reshape(node["shape"]).clone()
