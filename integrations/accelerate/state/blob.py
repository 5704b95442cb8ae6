"""Pickle-free storage of small nested states: ``NAME.json`` (strict JSON) + ``NAME.safetensors``.

Used for schedulers, dataloader/sampler positions, the grad scaler, RNG states and registered custom
objects. The codec is the package's one (:mod:`fsdp_plugin.checkpoint.codec`): tuples, non-finite floats,
int dict keys and tensors; loading only parses JSON and safetensors.
"""
from __future__ import annotations

import json
import os
from typing import Any

from fsdp_plugin.checkpoint.codec import decode_state, encode_state
from safetensors.torch import load_file, save_file
from fsdp_plugin.checkpoint.errors import CheckpointNotFoundError


def write_blob(directory: str, name: str, obj: Any) -> None:
    """Write ``obj`` as ``directory/name.json`` (+ ``name.safetensors`` when it holds tensors)."""
    tree, tensors = encode_state(obj)
    if tensors:
        save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()},
                  os.path.join(directory, name + ".safetensors"))
    with open(os.path.join(directory, name + ".json"), "w") as f:
        json.dump({"tree": tree, "has_tensors": bool(tensors)}, f, allow_nan=False)


def read_blob(directory: str, name: str) -> Any:
    """Inverse of :func:`write_blob`; raises ``FileNotFoundError`` naming the missing file."""
    path = os.path.join(directory, name + ".json")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} is missing from the accelerate state directory {directory}")
    with open(path) as f:
        doc = json.load(f)
    tensors = load_file(os.path.join(directory, name + ".safetensors")) if doc.get("has_tensors") else {}
    return decode_state(doc["tree"], tensors)


def blob_exists(directory: str, name: str) -> bool:
    """Whether ``directory/name.json`` exists."""
    return os.path.exists(os.path.join(directory, name + ".json"))
