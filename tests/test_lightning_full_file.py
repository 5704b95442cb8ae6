"""The 'full' Lightning checkpoint file: torch's format for Lightning (weights_only=True), read back by us
without pickle through the JSON index; damaged files raise CorruptCheckpointError. In-process, no Trainer."""
from __future__ import annotations

import json
import pickle
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from fsdp_plugin.checkpoint import CheckpointError, CorruptCheckpointError
from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
from fsdp_plugin.integrations.lightning.checkpoint import torch_file as torch_file


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 5, generator=g)
    tied = torch.randn(3, 4, generator=g)
    return {"emb.weight": tied, "head.weight": tied, "view": big[1:3, ::2], "bf16": torch.randn(7, generator=g).bfloat16(),
            "ids": torch.arange(5), "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5), "big": big}


def _no_pickle(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("unpickling on fsdp_plugin's load path")

    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)


def test_roundtrip_is_exact_for_us_and_for_torch_weights_only(tmp_path, monkeypatch):
    state, path = _state(), tmp_path / "full.ckpt"
    meta = {"epoch": 1, "hyper_parameters": {"lr": 0.1, "betas": (0.9, 0.95)}, "callbacks": {"cb": torch.tensor(3.0)}}
    torch_file.write(path, state, meta, {"note": [1, "x"]})
    loaded = torch.load(path, weights_only=True)
    assert loaded["epoch"] == 1 and loaded["hyper_parameters"]["betas"] == (0.9, 0.95)
    with monkeypatch.context() as m:
        _no_pickle(m)
        ours, extra = torch_file.read(path)
    assert extra == {"note": [1, "x"]} and list(ours) == list(state)
    for name, want in state.items():
        for got in (ours[name], loaded["state_dict"][name]):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_index"])
def test_damaged_files_raise(tmp_path, damage):
    path = tmp_path / "full.ckpt"
    torch_file.write(path, _state(), {}, None)
    if damage == "no_index":
        torch.save({"state_dict": _state()}, path)
    else:
        with zipfile.ZipFile(path) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith("/data/7"))  # "big": 120 bytes
        data = bytearray(path.read_bytes())
        h = info.header_offset  # local header: name and extra-field lengths at bytes 26 and 28 (torch pads extra)
        start = h + 30 + int.from_bytes(data[h + 26:h + 28], "little") + int.from_bytes(data[h + 28:h + 30], "little")
        assert torch.equal(torch.frombuffer(data[start:start + 120], dtype=torch.float32), _state()["big"].view(-1))
        if damage == "flip":
            data[start + 17] ^= 0x40
        else:
            data = data[: start + 50]
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError if damage == "no_index" else CorruptCheckpointError):
        torch_file.read(path)


def test_full_files_of_earlier_versions_still_load(tmp_path):
    """Up to this change 'full' was safetensors with the Lightning state as JSON in the header metadata."""
    tree, tensors = ckpt.encode_meta({"epoch": 2, "global_step": 8})
    state = {"w": torch.ones(2, 2)}
    save_file(state, str(tmp_path / "old.ckpt"),
              metadata={"format": "pt", ckpt.FULL_META_KEY: json.dumps(ckpt.inline_tensors(tree, tensors))})
    got, header = ckpt.read_full(tmp_path / "old.ckpt")
    assert torch.equal(got["w"], state["w"]) and ckpt.decode_state(*ckpt._outline_tensors(header))["global_step"] == 8


def test_consolidate_lightning_refuses_a_checkpoint_without_lightning_state(tmp_path, capsys):
    import fsdp_plugin as fp
    from fsdp_plugin.cli import main

    fp.save_checkpoint(str(tmp_path / "ckpt"), fp.shard(torch.nn.Sequential(torch.nn.Linear(2, 2))))
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out.ckpt"), "--format", "lightning"]) == 1
    assert "fsdp-plugin consolidate CKPT OUT" in capsys.readouterr().err and not (tmp_path / "out.ckpt").exists()
