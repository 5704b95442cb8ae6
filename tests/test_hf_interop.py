"""Hugging Face safetensors interop: load_pretrained into sharded models, save_pretrained without gather,
offline consolidate + CLI, index/path validation."""
from __future__ import annotations

import json
import os
import resource

import pytest
import torch
from _dist import run_ranks
from models import GPT, Block
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_pretrained,
    save_checkpoint,
    save_pretrained,
)
from fsdp_plugin.cli import main as cli

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _gpt(seed):
    torch.manual_seed(seed)
    return GPT(vocab=64, d=16, n_layer=2, seq=16)


def _reference(dtype=torch.float32):
    """The plain model's state dict as HF would save it (tied head dropped)."""
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _gpt(0).state_dict().items()}
    sd.pop("head.weight")
    return sd


def _load_sharded(rank, world, path, strategy):
    model = _gpt(99)
    fp.shard(model, sharding_strategy=strategy, auto_wrap_policy={Block})
    report = load_pretrained(model, path)
    assert not report
    return fp.full_state_dict(model)


def _write_hf(tmp_path, dtype, sharded):
    d = tmp_path / f"hf-{dtype}-{sharded}"
    d.mkdir()
    sd = _reference(dtype)
    if not sharded:
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
        return d
    names = sorted(sd)
    half = len(names) // 2
    wm = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in chunk}, d / fname, metadata={"format": "pt"})
        wm.update({n: fname for n in chunk})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d


@pytest.mark.parametrize("world,dtype,sharded", [(1, torch.float32, False), (2, torch.bfloat16, True),
                                                 (4, torch.float32, True)])
def test_load_pretrained_into_sharded_model(tmp_path, world, dtype, sharded):
    d = _write_hf(tmp_path, dtype, sharded)
    full = run_ranks(_load_sharded, world, str(d), "full_shard", timeout=120)[0]
    ref = _gpt(0).state_dict()
    for k, v in ref.items():
        expect = v.to(dtype).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(full[k], expect), k


def _save_hf(rank, world, path, gather):
    model = _gpt(0)
    fp.shard(model, sharding_strategy="full_shard", auto_wrap_policy={Block})
    save_pretrained(model, path, max_shard_size="20KB", gather=gather)


@pytest.mark.parametrize("gather", [None, True])
def test_save_pretrained_sharded(tmp_path, gather):
    """Default: each rank pwrites its own pieces (no gather); gather=True: the no-shared-filesystem fallback."""
    out = tmp_path / "out"
    run_ranks(_save_hf, 3, str(out), gather, timeout=120)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(os.listdir(out)) == sorted(files + ["model.safetensors.index.json"])
    sd = {}
    for f in files:
        with safe_open(str(out / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
        sd.update(load_file(out / f))
    ref = _reference()
    assert sd.keys() == ref.keys() and "head.weight" not in sd
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    model = _gpt(5)
    load_pretrained(model, out)  # and back
    for k, v in _gpt(0).state_dict().items():
        assert torch.equal(model.state_dict()[k], v)


def _save_ckpt(rank, world, path):
    model = _gpt(0)
    fp.shard(model, sharding_strategy="full_shard", auto_wrap_policy={Block})
    save_checkpoint(path, model, torch.optim.AdamW(model.parameters()), extra={"epoch": 3})


def test_consolidate_cli_inspect_verify(tmp_path, capsys):
    ck, out = tmp_path / "ck", tmp_path / "hf"
    run_ranks(_save_ckpt, 3, str(ck), timeout=120)
    assert cli(["inspect", str(ck)]) == 0
    text = capsys.readouterr().out
    assert "world size 3" in text and "full_shard" in text and "tok.weight: F32" in text and '"epoch": 3' in text
    assert cli(["verify", "-q", str(ck)]) == 0
    assert cli(["consolidate", str(ck), str(out), "--max-shard-size", "30KB"]) == 0
    sd = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            sd.update(load_file(out / f))
    plain = _gpt(7)
    plain.load_state_dict(sd)  # strict: every name, tied alias included
    for k, v in _gpt(0).state_dict().items():
        assert torch.equal(plain.state_dict()[k], v)
    assert cli(["consolidate", "-q", str(ck), str(tmp_path / "hub"), "--drop-tied"]) == 0
    hub = load_file(tmp_path / "hub" / "model.safetensors")
    assert "head.weight" not in hub and hub.keys() == _reference().keys()
    f = ck / "rank00001.model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    assert cli(["verify", "-q", str(ck)]) == 1
    assert "rank00001.model.safetensors: block 0" in capsys.readouterr().err
    assert cli(["consolidate", "-q", str(ck), str(tmp_path / "bad")]) == 1
    assert not [n for n in os.listdir(tmp_path / "bad") if n.endswith(".safetensors")]


def test_load_pretrained_mismatch_and_paths(tmp_path):
    d = _write_hf(tmp_path, torch.float32, sharded=True)
    other = GPT(vocab=64, d=16, n_layer=3, seq=16)
    with pytest.raises(CheckpointMismatchError, match="blocks.2"):
        load_pretrained(other, d)
    report = load_pretrained(other, d, strict=False)
    assert report.missing and all(n.startswith("blocks.2.") for n in report.missing)
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["tok.weight"] = "../evil.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="unsafe"):
        load_pretrained(_gpt(1), d)


def test_load_pretrained_hf_cache_symlinks(tmp_path):
    """Snapshot files of the HF cache link to ../../blobs: allowed; links leaving the repo: refused."""
    repo = tmp_path / "models--x"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    save_file(_reference(), repo / "blobs" / "sha", metadata={"format": "pt"})
    os.symlink("../../blobs/sha", snap / "model.safetensors")
    model = _gpt(3)
    load_pretrained(model, snap)
    assert torch.equal(model.tok.weight, _gpt(0).tok.weight)
    evil = tmp_path / "evil"
    evil.mkdir()
    os.replace(repo / "blobs" / "sha", tmp_path / "elsewhere.safetensors")
    os.remove(snap / "model.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "model.safetensors")
    with pytest.raises(CheckpointError, match="leaves the checkpoint directory"):
        load_pretrained(_gpt(3), snap)


def _consolidate_rss(ck, out, q):
    from fsdp_plugin.checkpoint import consolidate

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    consolidate(ck, out, "150MB")
    q.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)


@pytest.mark.slow
def test_consolidate_memory_is_bounded(tmp_path):
    """Export of 2 x 128 MB tensors raises peak RSS by < 64 MB."""
    import multiprocessing as mp

    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192, bias=False), torch.nn.Linear(8192, 4096, bias=False))
    save_checkpoint(tmp_path / "ck", model)
    del model
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consolidate_rss, args=(str(tmp_path / "ck"), str(tmp_path / "hf"), q))
    p.start()
    delta_kb = q.get(timeout=300)
    p.join()
    assert delta_kb < 64 * 1024, f"peak RSS grew by {delta_kb / 1024:.0f} MB"


def test_cli_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    """``fsdp-plugin inspect CKPT | head -1``: the reader leaves early; no traceback, the SIGPIPE status."""
    import subprocess
    import sys
    ck = tmp_path / "ck"
    run_ranks(_save_ckpt, 2, str(ck), timeout=120)
    r, w = os.pipe()
    os.close(r)   # the reader is gone before we write a byte: deterministic, unlike racing ``head``
    proc = subprocess.run([sys.executable, "-m", "fsdp_plugin.cli", "inspect", str(ck)], stdout=w,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr
