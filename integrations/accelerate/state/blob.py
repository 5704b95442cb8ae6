"""Pickle-free storage of small nested states: ``NAME.json`` (strict JSON) + ``NAME.safetensors``.

Used for schedulers, dataloader/sampler positions, the grad scaler, RNG states and registered custom
objects. The codec is the package's one (:mod:`fsdp_plugin.checkpoint.format.codec`): tuples, non-finite floats,
int dict keys and tensors; loading only parses JSON and safetensors.
"""
from __future__ import annotations

import json
import os
from typing import Any

from fsdp_plugin.checkpoint.format.codec import decode_state, encode_state
from safetensors.torch import load, load_file, save, save_file

from fsdp_plugin.checkpoint import storage
from fsdp_plugin.checkpoint.errors import CheckpointNotFoundError


def write_blob(directory: str, name: str, obj: Any) -> None:
    """Write ``obj`` as ``directory/name.json`` (+ ``name.safetensors`` when it holds tensors); ``directory`` may be
    an object-store URL (each file one PUT)."""
    tree, tensors = encode_state(obj)
    if storage.is_url(directory):
        st = storage.storage_for(directory)
        if tensors:
            st.create_exclusive(storage.join(directory, name + ".safetensors"),
                                save({k: t.detach().cpu().contiguous() for k, t in tensors.items()}), exclusive=False)
        st.create_exclusive(storage.join(directory, name + ".json"),
                            json.dumps({"tree": tree, "has_tensors": bool(tensors)}, allow_nan=False).encode(),
                            exclusive=False)
        return
    if tensors:
        save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()},
                  os.path.join(directory, name + ".safetensors"))
    with open(os.path.join(directory, name + ".json"), "w") as f:
        json.dump({"tree": tree, "has_tensors": bool(tensors)}, f, allow_nan=False)


def read_blob(directory: str, name: str) -> Any:
    """Inverse of :func:`write_blob`; raises ``FileNotFoundError`` naming the missing file."""
    if storage.is_url(directory):
        return _read_remote(directory, name)
    path = os.path.join(directory, name + ".json")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} is missing from the accelerate state directory {directory}")
    with open(path) as f:
        doc = json.load(f)
    tensors = load_file(os.path.join(directory, name + ".safetensors")) if doc.get("has_tensors") else {}
    return decode_state(doc["tree"], tensors)


def _read_remote(directory: str, name: str) -> Any:
    st, path = storage.storage_for(directory), storage.join(directory, name + ".json")
    raw = st.read_small(path, _MAX_BYTES)
    if raw is None:
        raise CheckpointNotFoundError(f"{path} is missing from the accelerate state at {directory}")
    doc = json.loads(raw)
    tensors = {}
    if doc.get("has_tensors"):
        data = st.read_small(storage.join(directory, name + ".safetensors"), _MAX_BYTES)
        if data is None:
            raise CheckpointNotFoundError(f"{storage.join(directory, name + '.safetensors')} is missing")
        tensors = load(data)
    return decode_state(doc["tree"], tensors)


#: Largest small-state object read from an object store (bytes).
_MAX_BYTES = 256 << 20


def blob_exists(directory: str, name: str) -> bool:
    """Whether ``directory/name.json`` exists."""
    if storage.is_url(directory):
        return storage.storage_for(directory).size(storage.join(directory, name + ".json")) is not None
    return os.path.exists(os.path.join(directory, name + ".json"))
