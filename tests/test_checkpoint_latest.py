"""``fp.latest_checkpoint(root)``: the newest complete checkpoint; interrupted, replaced, corrupt or
truncated ones are skipped; under a process group every rank gets rank 0's choice."""
from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks


def _model():
    torch.manual_seed(0)
    return fp.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), auto_wrap_policy={nn.Linear})


def _save(root, name, step=None):
    fp.save_checkpoint(os.path.join(root, name), _model(), extra={"step": step} if step is not None else None)
    return os.path.join(root, name)


def _model_file(path):
    return os.path.join(path, next(f for f in sorted(os.listdir(path)) if f.endswith(".model.safetensors")))


def test_the_newest_complete_checkpoint_wins(tmp_path):
    root = str(tmp_path)
    assert fp.latest_checkpoint(os.path.join(root, "missing")) is None
    assert fp.latest_checkpoint(root) is None
    _save(root, "step003", 3)
    good = _save(root, "step006", 6)
    for name in ("step009", "step012.tmp-abc", "step015.old-abc", "step018", "step021"):
        shutil.copytree(good, os.path.join(root, name))
    os.remove(os.path.join(root, "step009", "manifest.json"))              # the save was interrupted
    with open(os.path.join(root, "step018", "manifest.json"), "w") as f:   # not a manifest any more
        f.write("{")
    with open(_model_file(os.path.join(root, "step021")), "r+b") as f:     # a file cut short
        f.truncate(10)
    assert fp.latest_checkpoint(root) == good


def test_step_orders_before_creation_time_and_verify_reads_the_crcs(tmp_path):
    root = str(tmp_path)
    first = _save(root, "b-step010", 10)
    _save(root, "a-step004", 4)                   # written later, but an earlier step
    assert fp.latest_checkpoint(root) == first
    with open(_model_file(first), "r+b") as f:    # same size, one flipped byte in the data
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert fp.latest_checkpoint(root) == first    # the cheap check only reads manifests and sizes
    assert fp.latest_checkpoint(root, verify=True) == os.path.join(root, "a-step004")


def test_without_a_step_the_newest_manifest_wins(tmp_path):
    root = str(tmp_path)
    _save(root, "z")
    newer = _save(root, "a")
    doc = json.load(open(os.path.join(newer, "manifest.json")))
    assert "step" not in json.dumps(doc.get("extra", {}))
    assert fp.latest_checkpoint(root) == newer


def _every_rank_gets_rank0s_choice(rank, world, root):
    return fp.latest_checkpoint(root if rank == 0 else os.path.join(root, "not-what-rank-0-sees"))


def test_every_rank_loads_what_rank_0_chose(tmp_path):
    path = _save(str(tmp_path), "step001", 1)
    assert run_ranks(_every_rank_gets_rank0s_choice, 2, str(tmp_path), timeout=60) == [path, path]
