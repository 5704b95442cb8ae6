"""Lightning state saved by the first release (its own tag scheme) still decodes, and to the right objects:
read as plain dicts, ``{"__tuple__": [...]}`` would silently become a dict instead of Adam's ``betas``."""
from __future__ import annotations

import base64
import math

import pytest
import torch

pytest.importorskip("lightning")

from fsdp_plugin.checkpoint.format import codec  # noqa: E402
from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt

V1_TREE = {"epoch": 3, "betas": {"__tuple__": [0.9, 0.999]}, "best": {"__float__": "inf"},
           "score": {"__tensor__": "t0"}, "again": {"__tensor__": "t0"},
           "state": {"__dict__": [[0, {"step": 7}]]}, "dtype": {"__dtype__": "bfloat16"},
           "hp": {"__namespace__": {"lr": 0.1}}, "size": {"__size__": [2, 3]}}


def test_first_release_tags_decode_to_the_objects_they_encoded():
    score = torch.tensor(0.25)
    got = ckpt.decode_state(V1_TREE, {"t0": score})
    assert got["epoch"] == 3 and got["betas"] == (0.9, 0.999) and math.isinf(got["best"])
    assert got["score"] is got["again"] and torch.equal(got["score"], score)
    assert got["state"] == {0: {"step": 7}} and got["dtype"] is torch.bfloat16
    assert got["hp"].lr == 0.1 and got["size"] == torch.Size([2, 3])


def test_current_codec_trees_are_not_taken_for_first_release_ones():
    obj = {"betas": (0.9, 0.999), "state": {0: {"step": 7}}, "best": float("inf"), "t": torch.ones(2)}
    tree, tensors = codec.encode_state(obj)
    got = ckpt.decode_state(tree, tensors)
    assert got["betas"] == (0.9, 0.999) and got["state"] == {0: {"step": 7}} and torch.equal(got["t"], obj["t"])


def test_first_release_full_file_header_with_base64_tensors():
    t = torch.arange(3, dtype=torch.float32)
    node = {"dtype": "float32", "shape": [3], "b64": base64.b64encode(t.numpy().tobytes()).decode()}
    tree, tensors = ckpt._outline_tensors({"tree": {"x": {"__tensor__": "t0"}}, "tensors": {"t0": node}})
    assert torch.equal(ckpt.decode_state(tree, tensors)["x"], t)
