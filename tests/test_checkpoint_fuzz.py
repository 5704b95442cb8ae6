"""Hostile checkpoint files: random byte damage and structured manifest lies (hypothesis).

Every load either succeeds or raises a documented CheckpointError subclass; nothing is opened outside the
checkpoint directory. Default run: a fast sample; `-m slow` runs the full campaign.
"""
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdp_plugin as fp
import fsdp_plugin.checkpoint.storage.fsio as fsio

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))


def _model():
    torch.manual_seed(0)
    return fp.shard(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    fp.save_checkpoint(str(root / "ckpt"), model, opt, extra={"step": 1, "rng": torch.arange(4)})
    return root / "ckpt"


def _load_confined(path):
    """Load into a fresh model; assert every opened path stays inside the checkpoint directory."""
    opened = []
    real_open = os.open

    def spy(p, *a, **k):
        opened.append(os.path.realpath(p))
        return real_open(p, *a, **k)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    fsio.os.open = spy
    try:
        fp.load_checkpoint(str(path), model, opt)
    except fp.CheckpointError:
        pass
    finally:
        fsio.os.open = real_open
    base = os.path.realpath(path)
    outside = [p for p in opened if p != base and not p.startswith(base + os.sep)]
    assert not outside, f"opened outside the checkpoint: {outside}"


def _fresh(pristine, tmp_path_factory):
    d = tmp_path_factory.mktemp("case") / "ckpt"
    shutil.copytree(pristine, d)
    return d


FILES = ["manifest.json", "rank00000.model.safetensors", "rank00000.optim.safetensors"]
damage = st.tuples(st.sampled_from(FILES), st.sampled_from(["truncate", "flip", "overwrite"]),
                   st.floats(0, 1), st.binary(min_size=1, max_size=16), st.integers(0, 7))


def _damage_bytes(d, case):
    name, kind, where, junk, bit = case
    path = d / name
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), len(data) - 1)
    if kind == "truncate":
        data = data[:at]
    elif kind == "flip":
        data[at] ^= 1 << bit
    else:
        data[at:at + len(junk)] = junk
    path.write_bytes(bytes(data))


HOSTILE_VALUES = st.one_of(st.integers(-2**63, 2**63), st.sampled_from(
    ["../../etc/passwd", "/etc/passwd", "a/../../b", "F64", "X9", "", None, [], {}, [[0, 0, 2**40]],
     [[0, 5, 3]], [[9, 0, 3]], [[0, 0, 3], [0, 1, 4]], [2**31, 2**31], 1e308, float("nan")]))


def _lie_in_manifest(d, path_choice, value):
    manifest = json.loads((d / "manifest.json").read_text())
    node = manifest
    for key in path_choice[:-1]:
        node = node[key]
    node[path_choice[-1]] = value
    (d / "manifest.json").write_text(json.dumps(manifest))


MANIFEST_FIELDS = st.sampled_from([
    ("world_size",), ("params", "0.weight", "shape"), ("params", "0.weight", "dtype"),
    ("params", "0.weight", "pieces"), ("params", "1.bias", "pieces"),
    ("files", "rank00000.model.safetensors", "bytes"), ("files", "rank00000.model.safetensors", "data_start"),
    ("files", "rank00000.model.safetensors", "crc32"), ("files", "rank00000.model.safetensors", "block_bytes"),
    ("optimizers", 0, "tensors", "0.weight", "exp_avg", "pieces"), ("version",), ("format",),
])


def _rename_file_entry(d, new_name):
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"][new_name] = manifest["files"].pop("rank00000.model.safetensors")
    (d / "manifest.json").write_text(json.dumps(manifest))


def _campaign(pristine, tmp_path_factory, case, kind):
    d = _fresh(pristine, tmp_path_factory)
    if kind == "bytes":
        _damage_bytes(d, case)
    elif kind == "manifest":
        _lie_in_manifest(d, *case)
    else:
        _rename_file_entry(d, case)
    _load_confined(d)
    shutil.rmtree(d.parent)


@FAST
@given(case=damage)
def test_byte_damage_sample(pristine, tmp_path_factory, case):
    _campaign(pristine, tmp_path_factory, case, "bytes")


@FAST
@given(field=MANIFEST_FIELDS, value=HOSTILE_VALUES)
def test_manifest_lies_sample(pristine, tmp_path_factory, field, value):
    _campaign(pristine, tmp_path_factory, (field, value), "manifest")


@FAST
@given(name=st.sampled_from(["../outside.safetensors", "/etc/passwd", "sub/../../x", "..", ".", "a\x00b"]))
def test_file_names_escaping_the_directory(pristine, tmp_path_factory, name):
    _campaign(pristine, tmp_path_factory, name, "rename")


@pytest.mark.slow
@SLOW
@given(case=damage)
def test_byte_damage_campaign(pristine, tmp_path_factory, case):
    _campaign(pristine, tmp_path_factory, case, "bytes")


@pytest.mark.slow
@SLOW
@given(field=MANIFEST_FIELDS, value=HOSTILE_VALUES)
def test_manifest_lies_campaign(pristine, tmp_path_factory, field, value):
    _campaign(pristine, tmp_path_factory, (field, value), "manifest")


@pytest.mark.parametrize("key", ["params", "buffers"])
def test_manifest_missing_a_section_is_corrupt(pristine, tmp_path_factory, key):
    """A flipped byte in a section's key leaves valid JSON without that section (found by the byte campaign)."""
    d = _fresh(pristine, tmp_path_factory)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest[key + "x"] = manifest.pop(key)
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(fp.CorruptCheckpointError, match=f"'{key}' is missing"):
        fp.load_checkpoint(str(d), _model())
