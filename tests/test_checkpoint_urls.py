"""Every checkpoint path argument that is a URL works (fsspec) or raises UnsupportedStorageError naming the
scheme; never a local directory named ``s3:`` (``os.path.abspath("s3://b/x")`` is ``<cwd>/s3:/b/x``).

Single process, ``memory://`` (fsspec's in-process object store; every test uses its own bucket name).
The S3 API server tests are in test_checkpoint_s3.py.
"""
from __future__ import annotations

import json
import os
import uuid

import fsspec
import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import consolidate, inspect_checkpoint, verify_checkpoint
from fsdp_plugin.checkpoint.storage import remote
from fsdp_plugin.checkpoint.errors import UnsupportedStorageError


def _model(seed=0):
    torch.manual_seed(seed)
    return fp.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), auto_wrap_policy={nn.Linear})


def _trained(seed=0):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def _bucket() -> str:
    return f"memory://b{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Run in an empty cwd: after each test it must still be empty (no ``s3:`` / ``memory:`` directory)."""
    monkeypatch.chdir(tmp_path)
    yield
    assert not [n for n in os.listdir(tmp_path) if n.endswith(":")], os.listdir(tmp_path)


def test_save_load_latest_on_memory_url_bit_exact():
    root = _bucket() + "/run"
    m, opt = _trained()
    fp.save_checkpoint(f"{root}/step1", m, opt, extra={"step": 1})
    fp.save_checkpoint(f"{root}/step2/", m, opt, extra={"step": 2})  # trailing slash: same prefix rules
    assert fp.latest_checkpoint(root) == f"{root}/step2"
    m2, opt2 = _model(1), None
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    assert fp.load_checkpoint(f"{root}/step2", m2, opt2) == {"step": 2}
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for p in m.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[dict(zip(m.parameters(), m2.parameters()))[p]][k])


def test_replacing_keeps_one_prefix_and_the_manifest_names_it():
    path = _bucket() + "/ck"
    m, _ = _trained()
    fp.save_checkpoint(path, m, extra={"step": 1})
    fs = fsspec.filesystem("memory")
    first = json.loads(fs.cat(path + "/manifest.json"))["uuid"]
    fp.save_checkpoint(path, m, extra={"step": 2})
    doc = json.loads(fs.cat(path + "/manifest.json"))
    assert doc["uuid"] != first
    assert sorted(n.rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)) == sorted([doc["uuid"], "manifest.json"])


def test_without_a_conditional_put_a_replace_since_the_save_began_is_refused(monkeypatch):
    """memory:// reports no ETag: the save re-reads the manifest just before its PUT (the fallback)."""
    from fsdp_plugin.checkpoint.storage import _publish_remote

    path = _bucket() + "/ck"
    fp.save_checkpoint(path, _trained(0)[0], extra={"step": 1})
    assert not remote.ObjectStorage(path).conditional_replace
    real, seen = _publish_remote.publish, []

    def another_save_first(tmp, p, data, base):
        if not seen:
            seen.append(base)
            fp.save_checkpoint(path, _trained(2)[0], extra={"step": 3})  # publishes while this save "uploads"
        return real(tmp, p, data, base)

    monkeypatch.setattr(_publish_remote, "publish", another_save_first)
    with pytest.raises(fp.CheckpointError, match=r"another save replaced the checkpoint .*step 3.*its own root"):
        fp.save_checkpoint(path, _trained(1)[0], extra={"step": 2})
    assert seen[0].token is None
    monkeypatch.undo()
    assert fp.load_checkpoint(path, _model()) == {"step": 3}
    assert len(fsspec.filesystem("memory").ls(path, detail=False)) == 2  # the winner's prefix and its manifest


def test_a_damaged_manifest_is_replaced_by_the_next_save():
    path = _bucket() + "/ck"
    fsspec.filesystem("memory").pipe(path + "/manifest.json", b"{not json")
    fp.save_checkpoint(path, _trained(0)[0], extra={"step": 7})
    assert fp.load_checkpoint(path, _model()) == {"step": 7}


def test_a_save_without_manifest_is_invisible_and_cleaned_by_the_next_save(monkeypatch):
    from fsdp_plugin.checkpoint.storage import _publish_remote

    root = _bucket() + "/run"
    m, _ = _trained()
    fp.save_checkpoint(f"{root}/step1", m, extra={"step": 1})
    fs = fsspec.filesystem("memory")
    orphan = f"{root}/step2/{uuid.uuid4().hex}/rank00000.model.safetensors"
    fs.pipe(orphan, b"partial upload")  # a killed save: objects, no manifest
    assert fp.latest_checkpoint(root) == f"{root}/step1"
    with pytest.raises(fp.CheckpointError, match="no checkpoint there"):
        fp.load_checkpoint(f"{root}/step2", _model())
    fp.save_checkpoint(f"{root}/step2", m, extra={"step": 2})  # a young prefix may be a save under way: kept
    assert fs.exists(orphan)
    monkeypatch.setattr(_publish_remote, "STALE_S", 0.0)
    with pytest.warns(UserWarning, match="interrupted checkpoint save"):
        fp.save_checkpoint(f"{root}/step2", m, extra={"step": 2})
    assert not fs.exists(orphan)
    assert fp.latest_checkpoint(root) == f"{root}/step2"


def test_corrupted_object_is_detected():
    path = _bucket() + "/ck"
    m, _ = _trained()
    fp.save_checkpoint(path, m)
    fs = fsspec.filesystem("memory")
    uid = json.loads(fs.cat(path + "/manifest.json"))["uuid"]
    obj = f"{path}/{uid}/rank00000.model.safetensors"
    data = bytearray(fs.cat(obj))
    data[-1] ^= 0xFF
    fs.pipe(obj, bytes(data))
    with pytest.raises(fp.CorruptCheckpointError, match="CRC32"):
        fp.load_checkpoint(path, _model())
    assert verify_checkpoint(path)  # problems found
    assert fp.latest_checkpoint(path.rsplit("/", 1)[0], verify=True) is None


def test_inspect_verify_consolidate_from_a_url(tmp_path):
    from safetensors.torch import load_file

    path = _bucket() + "/ck"
    m, _ = _trained()
    fp.save_checkpoint(path, m)
    info = inspect_checkpoint(path)
    assert info["path"] == path and info["layout"]["kind"] == "fsdp_plugin"
    assert verify_checkpoint(path) == []
    consolidate(path, str(tmp_path / "hf"))
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    with fp.full_params(m):
        for k, v in m.state_dict().items():
            assert torch.equal(out[k], v)


def test_loads_read_only_what_they_need():
    path = _bucket() + "/ck"
    m, opt = _trained()
    fp.save_checkpoint(path, m, opt)
    doc = json.loads(fsspec.filesystem("memory").cat(path + "/manifest.json"))
    before = remote.bytes_read
    fp.load_checkpoint(path, _model())  # no optimizer: its objects are not read
    model_bytes = doc["files"]["rank00000.model.safetensors"]["bytes"]
    got = remote.bytes_read - before
    assert model_bytes <= got < model_bytes + 8192, (got, model_bytes)  # + the manifest (and header twice)


@pytest.mark.parametrize("url", ["nosuchscheme://bucket/run/step1", "s3:/bucket/run/step1"])
def test_unusable_urls_raise_naming_the_scheme(url):
    scheme = url.split(":", 1)[0]
    m = _model()
    for call in (lambda: fp.save_checkpoint(url, m), lambda: fp.load_checkpoint(url, m),
                 lambda: fp.latest_checkpoint(url), lambda: inspect_checkpoint(url)):
        with pytest.raises(UnsupportedStorageError, match=scheme):
            call()
    assert verify_checkpoint(url) and scheme in verify_checkpoint(url)[0]


def test_local_only_entry_points_refuse_urls(tmp_path):
    url = _bucket() + "/x"
    m, _ = _trained()
    local = str(tmp_path / "ck")
    fp.save_checkpoint(local, m)
    with pytest.raises(UnsupportedStorageError, match=r"consolidate.*memory://"):
        consolidate(local, url)
    assert os.listdir(tmp_path) == ["ck"]


def test_dcp_export_to_a_url_and_import_from_it():
    from fsdp_plugin.checkpoint.dcp import export_dcp, is_dcp_dir, load_dcp

    m, opt = _trained()
    path, out = _bucket() + "/ck", _bucket() + "/dcp"
    fp.save_checkpoint(path, m, opt, extra={"step": 4})
    assert export_dcp(path, out) == out  # URL to URL
    fs = fsspec.filesystem("memory")
    assert ".metadata" in [n.rsplit("/", 1)[-1] for n in fs.ls(out, detail=False)]
    with pytest.raises(fp.CheckpointError, match="already holds objects"):
        export_dcp(path, out)
    m2 = _model(1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    assert load_dcp(out, m2, opt2) == {"extra": {"step": 4}}
    with fp.full_params(m), fp.full_params(m2):
        for a, b in zip(m.parameters(), m2.parameters()):
            assert torch.equal(a, b)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p2][k]), k
    assert not is_dcp_dir(out)  # a local-directory test: a URL is never taken for a local path


def test_file_urls_are_local_paths(tmp_path):
    m, _ = _trained()
    fp.save_checkpoint(f"file://{tmp_path}/ck", m, extra={"step": 3})
    assert os.path.isfile(tmp_path / "ck" / "manifest.json")
    assert fp.latest_checkpoint(f"file://{tmp_path}") == str(tmp_path / "ck")
    assert fp.load_checkpoint(f"file://{tmp_path}/ck", _model()) == {"step": 3}


def test_cli_reads_urls_and_refuses_url_outputs(tmp_path, capsys):
    from fsdp_plugin.cli import main

    path = _bucket() + "/ck"
    fp.save_checkpoint(path, _trained()[0])
    assert main(["inspect", path]) == 0 and path in capsys.readouterr().out
    assert main(["verify", "-q", path]) == 0
    assert main(["consolidate", "-q", path, str(tmp_path / "hf")]) == 0
    assert main(["consolidate", "-q", path, _bucket() + "/hf"]) == 1
    assert "memory://" in capsys.readouterr().err
    assert main(["inspect", "nosuchscheme://b/x"]) == 1
    assert "nosuchscheme" in capsys.readouterr().err


def test_integration_paths_refuse_or_keep_urls():
    from types import SimpleNamespace

    from fsdp_plugin.integrations.accelerate.state import dirs
    from fsdp_plugin.integrations.lightning.checkpoint import io as lightning_io
    from fsdp_plugin.integrations.transformers import _checkpoint

    url = _bucket() + "/state"
    acc = SimpleNamespace(project_configuration=SimpleNamespace(automatic_checkpoint_naming=False))
    assert dirs.output_dir(acc, url + "/") == url  # accelerate save_state on a bucket: test_checkpoint_s3_integrations
    with pytest.raises(fp.ConfigError, match="nothing is stored under"):
        dirs.input_dir(acc, url)
    for what, call in {"Trainer checkpoint": lambda: _checkpoint.save(SimpleNamespace(), url),
                       "Trainer resume": lambda: _checkpoint.load(SimpleNamespace(), url)}.items():
        with pytest.raises(UnsupportedStorageError, match=rf"{what}.*memory://"):
            call()
    assert lightning_io.as_path(url) == url  # Lightning's strategy keeps a URL a str (Path collapses '//')
    fp.save_checkpoint(url + "/ck", _trained()[0])
    assert lightning_io.checkpoint_kind(url + "/ck") == "sharded"
    assert lightning_io.checkpoint_kind(url + "/missing.ckpt") is None  # nothing there (a 'full' file is an object)
    fsspec.filesystem("memory").pipe(url + "/full.ckpt", b"PK\x03\x04")
    assert lightning_io.checkpoint_kind(url + "/full.ckpt") == "full"


def test_lightning_export_output_must_be_local():
    from fsdp_plugin.integrations.lightning.checkpoint.convert import consolidate_lightning

    with pytest.raises(UnsupportedStorageError, match="consolidate --format lightning.*memory://"):
        consolidate_lightning(_bucket() + "/ck", _bucket() + "/model.ckpt")


def test_load_pretrained_from_a_url(tmp_path):
    import fsspec

    m, _ = _trained()
    fp.save_pretrained(m, str(tmp_path / "hf"), max_shard_size="200B")  # split: an index and several files
    url = _bucket() + "/hf"
    fsspec.filesystem("memory").put(str(tmp_path / "hf") + "/", url, recursive=True)
    m2 = _model(1)
    assert not fp.load_pretrained(m2, url)
    with fp.full_params(m), fp.full_params(m2):
        for a, b in zip(m.parameters(), m2.parameters()):
            assert torch.equal(a, b)


def test_transient_errors_are_classified():
    import errno

    assert remote.transient(OSError(errno.EREMOTEIO, "Internal Server Error"))
    assert remote.transient(ConnectionError("Connection reset by peer"))
    assert remote.transient(OSError("SlowDown: Please reduce your request rate"))
    assert not remote.transient(FileNotFoundError("no such key"))
    assert not remote.transient(FileExistsError("At least one of the pre-conditions you specified did not hold"))
    assert not remote.transient(PermissionError("Access Denied"))


def test_save_pretrained_to_a_url_then_load_it(tmp_path):
    import fsspec
    from safetensors.torch import load_file

    m, _ = _trained()
    url = _bucket() + "/hf"
    fp.save_pretrained(m, url, max_shard_size="200B")
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False))
    assert "model.safetensors.index.json" in names and len(names) > 2, names
    fs.get(url + "/", str(tmp_path / "hf"), recursive=True)
    with fp.full_params(m):
        want = m.state_dict()
    got = {}
    for n in names:
        if n.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "hf" / n)))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    m2 = _model(1)
    fp.load_pretrained(m2, url)
    with fp.full_params(m2):
        assert all(torch.equal(v, want[k]) for k, v in m2.state_dict().items())
