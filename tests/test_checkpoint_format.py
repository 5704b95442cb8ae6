"""Single-process tests of the checkpoint format: round trips, corruption, hostile inputs, no pickle."""
from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import struct

import pytest
import torch
from test_checkpoint_support import TiedNet
from torch import nn

from fsdp_plugin.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMismatchWarning,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchReport,
    consolidate,
    load_checkpoint,
    load_pretrained,
    save_checkpoint,
    save_pretrained,
    verify_checkpoint,
)
from fsdp_plugin.checkpoint.format import manifest as mf
from fsdp_plugin.checkpoint.format.writer import write_safetensors


def _trained(seed=0):
    torch.manual_seed(seed)
    m = TiedNet()
    opts = [torch.optim.AdamW([m.emb.weight, m.l1.weight], lr=1e-2, betas=(0.8, 0.9)),
            torch.optim.SGD([m.l1.bias], lr=0.1, momentum=0.9)]
    x = torch.randint(0, 13, (4, 5))
    for _ in range(2):
        m(x).sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    m.counts += 3
    return m, opts


def _fresh(seed=1):
    torch.manual_seed(seed)
    m = TiedNet()
    opts = [torch.optim.AdamW([m.emb.weight, m.l1.weight], lr=5.0), torch.optim.SGD([m.l1.bias], lr=5.0, momentum=0.5)]
    return m, opts


EXTRA = {"step": 7, "t": (1, 2.5, float("nan"), -math.inf), "rng": torch.get_rng_state(), "d": {3: "x"},
         "dtype": torch.bfloat16, "path": pathlib.Path("/a/b"), "nested": [{"__type__": "user"}, None, True],
         "big": 2**70, "small": torch.tensor([1.5, 2.5], dtype=torch.bfloat16), "m": torch.arange(6.).view(2, 3),
         "zero_d": torch.tensor(3), "empty": torch.zeros(0, 4)}


@pytest.fixture
def saved(tmp_path):
    m, opts = _trained()
    path = tmp_path / "ck"
    save_checkpoint(path, m, opts, extra=EXTRA)
    return path, m, opts


def _assert_extra(extra):
    assert extra["step"] == 7 and extra["d"] == {3: "x"} and extra["big"] == 2**70
    assert extra["t"][:2] == (1, 2.5) and math.isnan(extra["t"][2]) and extra["t"][3] == -math.inf
    assert torch.equal(extra["rng"], EXTRA["rng"]) and torch.equal(extra["small"], EXTRA["small"])
    assert extra["dtype"] is torch.bfloat16 and extra["path"] == pathlib.Path("/a/b")
    assert extra["nested"] == [{"__type__": "user"}, None, True]
    for k in ("m", "zero_d", "empty"):
        assert torch.equal(extra[k], EXTRA[k]) and extra[k].shape == EXTRA[k].shape, k


def test_roundtrip_tied_frozen_buffers_two_optimizers(saved):
    path, m, opts = saved
    m2, opts2 = _fresh()
    assert not opts2[0].state  # fresh optimizers: the load must create the state
    _assert_extra(load_checkpoint(path, m2, opts2))
    assert m2.head.weight is m2.emb.weight
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    for o, o2 in zip(opts, opts2):
        a, b = o.state_dict(), o2.state_dict()
        assert a["param_groups"] == b["param_groups"]
        assert a["state"].keys() == b["state"].keys()
        for i in a["state"]:
            for k, v in a["state"][i].items():
                assert torch.equal(v, b["state"][i][k]) and v.dtype == b["state"][i][k].dtype, (i, k)


def test_load_into_untied_model_and_model_only(saved):
    path, m, _ = saved
    m2 = TiedNet()
    m2.head.weight = nn.Parameter(torch.zeros_like(m2.head.weight))  # untied: both names load the same values
    load_checkpoint(path, m2)
    assert torch.equal(m2.head.weight, m.emb.weight) and torch.equal(m2.emb.weight, m.emb.weight)


def test_no_pickle_on_any_load_path(saved, tmp_path, monkeypatch):
    path, m, _ = saved
    save_pretrained(m, tmp_path / "hf")

    def boom(*a, **k):
        raise AssertionError("pickle used on a load path")

    class NoUnpickler:
        def __init__(self, *a, **k):
            boom()

    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, boom)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", boom)
    m2, opts2 = _fresh()
    _assert_extra(load_checkpoint(path, m2, opts2))
    load_pretrained(TiedNet(), tmp_path / "hf")
    consolidate(path, tmp_path / "out")
    assert verify_checkpoint(path) == []


def test_mismatched_model_names_missing_unexpected_and_shapes(saved):
    path, _, _ = saved
    other = TiedNet(vocab=13, d=6)
    other.l1 = nn.Linear(6, 9)        # shape mismatch (and frozen's input no longer matches: not our problem)
    other.extra_layer = nn.Linear(2, 2)  # missing from the checkpoint
    del other.frozen                  # unexpected in the checkpoint
    with pytest.raises(CheckpointMismatchError) as ei:
        load_checkpoint(path, other)
    msg = str(ei.value)
    assert "extra_layer.weight" in msg and "frozen.weight" in msg and "l1.weight" in msg
    before = other.extra_layer.weight.detach().clone()
    report = MismatchReport()
    with pytest.warns(CheckpointMismatchWarning):
        load_checkpoint(path, other, strict=False, report=report)
    assert set(report.missing) == {"extra_layer.weight", "extra_layer.bias"}
    assert {"frozen.weight", "frozen.bias"} <= set(report.unexpected)
    assert set(report.mismatched) == {"l1.weight", "l1.bias"}
    assert torch.equal(other.extra_layer.weight, before)
    assert torch.equal(other.emb.weight, saved[1].emb.weight)  # the intersection was loaded


def test_strict_mismatch_touches_nothing(saved):
    path, _, _ = saved
    m2, opts2 = _fresh()
    m2.extra_layer = nn.Linear(2, 2)
    before = m2.emb.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(path, m2, opts2)
    assert torch.equal(m2.emb.weight, before) and not opts2[0].state and opts2[0].param_groups[0]["lr"] == 5.0


def test_optimizer_count_mismatch(saved, tmp_path):
    path, m, _ = saved
    m2, opts2 = _fresh()
    with pytest.raises(CheckpointMismatchError, match="2 optimizer"):
        load_checkpoint(path, m2, opts2[:1])
    save_checkpoint(tmp_path / "model_only", m)
    with pytest.warns(CheckpointMismatchWarning, match=r"optimizer\[0\]"):
        load_checkpoint(tmp_path / "model_only", m2, opts2[0], strict=False)
    assert torch.equal(m2.l1.weight, m.l1.weight) and not opts2[0].state


def test_meta_model_is_refused(saved):
    path, _, _ = saved
    with torch.device("meta"):
        m = TiedNet()
    with pytest.raises(CheckpointError, match="meta device"):
        load_checkpoint(path, m)


# -- damaged files ------------------------------------------------------------------------------------------
def _rank_file(path):
    return os.path.join(path, mf.file_name(0, "model"))


def test_truncated_file_is_named(saved):
    path, _, _ = saved
    f = _rank_file(path)
    os.truncate(f, os.path.getsize(f) - 1)
    with pytest.raises(CorruptCheckpointError, match=r"rank00000\.model\.safetensors.*truncated"):
        load_checkpoint(path, TiedNet())


def test_flipped_data_byte_fails_crc(saved):
    path, _, _ = saved
    f = _rank_file(path)
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) - 3)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match=r"rank00000\.model\.safetensors: block 0 .*CRC32"):
        load_checkpoint(path, TiedNet())
    assert any("CRC32" in p for p in verify_checkpoint(path))


@pytest.mark.parametrize("pos", [8, 20, 60])
def test_flipped_header_byte(saved, pos):
    path, _, _ = saved
    with open(_rank_file(path), "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError, match=r"rank00000\.model\.safetensors"):
        load_checkpoint(path, TiedNet())


def test_huge_header_length_is_bounded(saved):
    path, _, _ = saved
    with open(_rank_file(path), "r+b") as fh:
        fh.write(struct.pack("<Q", 1 << 62))
    with pytest.raises(CorruptCheckpointError, match="cap|CRC32"):
        load_checkpoint(path, TiedNet())


def _rewrite_manifest(path, fn):
    p = os.path.join(path, mf.NAME)
    with open(p) as f:
        doc = json.load(f)
    fn(doc)
    with open(p, "w") as f:
        json.dump(doc, f)


def test_wrong_dtype_in_file_header(saved):
    """A file whose header disagrees with the manifest (valid CRCs): the dtype mismatch names file and tensor."""
    path, m, _ = saved
    f = _rank_file(path)
    os.remove(f)
    tensors = [(n, p.detach().reshape(-1), (p.numel(),)) for n, p in m.named_parameters()]
    tensors = [(n, t.view(torch.int32) if n == "l1.weight" else t, s) for n, t, s in tensors]
    tensors += [(n, b, (b.numel(),)) for n, b in m.state_dict().items() if n in ("scale", "counts")]
    rec = write_safetensors(f, tensors, {"format": "pt"})
    _rewrite_manifest(path, lambda d: d["files"].__setitem__(mf.file_name(0, "model"), rec.to_json()))
    with pytest.raises(CorruptCheckpointError, match=r"rank00000\.model\.safetensors: tensor 'l1\.weight' is I32"):
        load_checkpoint(path, TiedNet())


def test_missing_rank_file(saved):
    path, _, _ = saved
    os.remove(_rank_file(path))
    with pytest.raises(CorruptCheckpointError, match=r"rank00000\.model\.safetensors: file is missing"):
        load_checkpoint(path, TiedNet())


def test_missing_manifest_is_incomplete(saved):
    path, _, _ = saved
    os.remove(os.path.join(path, mf.NAME))
    with pytest.raises(IncompleteCheckpointError, match="interrupted"):
        load_checkpoint(path, TiedNet())


def test_manifest_from_another_model(saved, tmp_path):
    path, _, _ = saved
    other = nn.Sequential(nn.Linear(3, 4))
    save_checkpoint(tmp_path / "other", other)
    os.replace(tmp_path / "other" / mf.NAME, os.path.join(path, mf.NAME))
    with pytest.raises(CheckpointError, match="0.weight|rank00000"):
        load_checkpoint(path, TiedNet())


@pytest.mark.parametrize("hostile,exc,match", [
    (lambda d: d["files"].__setitem__("../evil.safetensors", d["files"]["rank00000.model.safetensors"]),
     CheckpointError, "unsafe|not a rank file"),
    (lambda d: d["params"]["l1.bias"].__setitem__("pieces", [[0, 0, 5], [0, 3, 7]]), CorruptCheckpointError,
     "overlap"),
    (lambda d: d["params"]["l1.bias"].__setitem__("shape", [1 << 40, 1 << 40]), CorruptCheckpointError, "too large"),
    (lambda d: d["params"]["l1.bias"].__setitem__("dtype", "F33"), CorruptCheckpointError, "invalid entry"),
    (lambda d: d.__setitem__("version", 99), CheckpointError, "version"),
    (lambda d: d["params"]["l1.bias"]["pieces"][0].__setitem__(0, 5), CorruptCheckpointError, "invalid piece"),
])
def test_hostile_manifest(saved, hostile, exc, match):
    path, _, _ = saved
    _rewrite_manifest(path, hostile)
    with pytest.raises(exc, match=match):
        load_checkpoint(path, TiedNet())


def test_manifest_duplicate_keys_and_nan_rejected(saved):
    path, _, _ = saved
    p = os.path.join(path, mf.NAME)
    text = pathlib.Path(p).read_text()
    pathlib.Path(p).write_text(text[:-1] + ', "world_size": 1}')
    with pytest.raises(CorruptCheckpointError, match="duplicate key"):
        load_checkpoint(path, TiedNet())
    pathlib.Path(p).write_text(text[:-1] + ', "x": NaN}')
    with pytest.raises(CorruptCheckpointError, match="non-finite"):
        load_checkpoint(path, TiedNet())


def test_symlink_out_of_checkpoint_refused(saved, tmp_path):
    path, _, _ = saved
    f = _rank_file(path)
    outside = tmp_path / "outside.safetensors"
    os.replace(f, outside)
    os.symlink(outside, f)
    with pytest.raises(CheckpointError, match="symlink"):
        load_checkpoint(path, TiedNet())


# -- saving -------------------------------------------------------------------------------------------------
def test_save_replaces_previous_and_cleans_leftovers(tmp_path):
    m, opts = _trained()
    path = tmp_path / "ck"
    save_checkpoint(path, m, opts, extra={"v": 1})
    stale = tmp_path / ("ck.tmp-" + "0" * 32)
    stale.mkdir()
    with torch.no_grad():
        m.l1.weight.add_(1)
    with pytest.warns(UserWarning, match="interrupted"):
        save_checkpoint(path, m, opts, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    m2 = TiedNet()
    assert load_checkpoint(path, m2)["v"] == 2 and torch.equal(m2.l1.weight, m.l1.weight)


def test_save_refuses_to_replace_foreign_directory(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="refusing"):
        save_checkpoint(tmp_path / "home", TiedNet())
    assert (tmp_path / "home" / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["home"]


def test_unsupported_extra_value_names_its_path(tmp_path):
    with pytest.raises(TypeError, match=r"extra\.cfg\.fn.*pickle"):
        save_checkpoint(tmp_path / "ck", TiedNet(), extra={"cfg": {"fn": lambda: 1}})
    assert not os.path.exists(tmp_path / "ck") and os.listdir(tmp_path) == []


def test_scalar_param_and_other_optimizers(tmp_path):
    """A 0-d parameter, and optimizers with other state (Adagrad sum/step, ASGD eta/mu/ax, Rprop)."""
    for cls in (torch.optim.Adagrad, torch.optim.ASGD, torch.optim.Rprop, torch.optim.NAdam):
        torch.manual_seed(0)
        m = nn.Linear(3, 2)
        m.temp = nn.Parameter(torch.tensor(0.7))
        o = cls(m.parameters(), lr=0.01)
        for _ in range(2):
            (m(torch.randn(4, 3)).sum() * m.temp).backward()
            o.step()
            o.zero_grad()
        save_checkpoint(tmp_path / cls.__name__, m, o)
        m2 = nn.Linear(3, 2)
        m2.temp = nn.Parameter(torch.tensor(0.0))
        o2 = cls(m2.parameters(), lr=0.5)
        load_checkpoint(tmp_path / cls.__name__, m2, o2)
        a, b = o.state_dict(), o2.state_dict()
        assert a["param_groups"] == b["param_groups"], cls
        for i in a["state"]:
            for k, v in a["state"][i].items():
                w = b["state"][i][k]
                assert (torch.equal(v, w) and v.shape == w.shape) if torch.is_tensor(v) else v == w, (cls, i, k)
