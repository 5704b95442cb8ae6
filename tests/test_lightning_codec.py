"""Unit tests for the pickle-free Lightning checkpoint codec (no Lightning, no process group)."""
import argparse
import json
import math
import pathlib

import pytest
import torch
from fsdp_plugin import CodecError
from fsdp_plugin.checkpoint.format.codec import decode_state as decode
from fsdp_plugin.checkpoint.format.codec import encode_state as encode
from safetensors.torch import load, save


def _roundtrip(obj):
    tree, tensors = encode(obj)
    text = json.dumps(tree, allow_nan=False)  # strict JSON
    blob = save(tensors) if tensors else None  # safetensors accepts them (no shared memory)
    return decode(json.loads(text), load(blob) if blob else {})


def test_shared_tensor_is_stored_once_and_stays_shared():
    score = torch.tensor(0.25)
    ckpt = {"best_model_score": score, "current_score": score, "best_k_models": {"/a/b.ckpt": score}}
    _, tensors = encode(ckpt)
    assert len(tensors) == 1
    out = _roundtrip(ckpt)
    assert out["best_model_score"] is out["current_score"] is out["best_k_models"]["/a/b.ckpt"]
    assert out["current_score"].item() == 0.25


def test_views_of_one_storage_are_cloned_for_safetensors():
    base = torch.arange(6.0)
    out = _roundtrip({"a": base[:3], "b": base[3:], "c": base})
    assert out["a"].tolist() == [0, 1, 2] and out["b"].tolist() == [3, 4, 5] and out["c"].numel() == 6


def test_non_finite_tuples_int_keys_and_torch_types():
    obj = {
        "best": math.inf, "worst": -math.inf, "nan": math.nan, "betas": (0.9, 0.95),
        "state": {0: {"step": torch.tensor(3.0)}, 1: {}}, "dtype": torch.bfloat16,
        "device": torch.device("cpu"), "size": torch.Size([2, 3]), "path": pathlib.Path("/x/y"),
        "ns": argparse.Namespace(lr=0.1), "set": {3, 1}, "nested": [(1, "a"), None, True, 2**40],
        "tuple_key": {(1, 2): "x"}, "tag_like": {"__tuple__": 5},
    }
    out = _roundtrip(obj)
    assert out["best"] == math.inf and out["worst"] == -math.inf and math.isnan(out["nan"])
    assert out["betas"] == (0.9, 0.95) and isinstance(out["betas"], tuple)
    assert list(out["state"]) == [0, 1] and out["state"][0]["step"].item() == 3.0
    assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu")
    assert out["size"] == torch.Size([2, 3]) and out["path"] == pathlib.Path("/x/y")
    assert out["ns"] == argparse.Namespace(lr=0.1) and out["set"] == {1, 3}
    assert out["nested"] == [(1, "a"), None, True, 2**40]
    assert out["tuple_key"] == {(1, 2): "x"} and out["tag_like"] == {"__tuple__": 5}


def test_real_optimizer_and_scheduler_state_roundtrip():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1, betas=(0.8, 0.9))
    p.grad = torch.ones(3)
    opt.step()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    out = _roundtrip({"opt": opt.state_dict(), "sched": plateau.state_dict()})
    opt2 = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.5)
    opt2.load_state_dict(out["opt"])
    assert opt2.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"], opt.state[p]["exp_avg"])
    assert out["sched"]["best"] == math.inf


def test_unsupported_value_names_the_key_path():
    class Custom:
        pass

    with pytest.raises(CodecError, match=r"hyper_parameters\.model\.cfg.*Custom.*save_hyperparameters"):
        encode({"hyper_parameters": {"model": {"cfg": Custom()}}})
    with pytest.raises(TypeError, match="hyper_parameters.fn"):
        encode({"hyper_parameters": {"fn": len}})
