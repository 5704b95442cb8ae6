"""The DCP reader on its own: any chunk layout read by exact byte ranges, allow-listed unpickling, and a
clear error on every rank for damaged directories."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from _dcp_source import groups, make_model, save_run
from _dist import run_ranks

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import (
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from fsdp_plugin.checkpoint.dcp import is_dcp_dir
from fsdp_plugin.checkpoint.dcp.items import tensor_header
from fsdp_plugin.checkpoint.dcp.metadata import TensorEntry, read_metadata
from fsdp_plugin.checkpoint.dcp.reading import DcpReader
from fsdp_plugin.checkpoint.errors import UnsafeCheckpointError

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _full_tensors():
    g = torch.Generator().manual_seed(7)
    return {"s0": torch.randn(5, 4, generator=g), "s1": torch.randn(5, 7, generator=g),
            "s2": torch.randn(3, 4, 5, generator=g), "rep": torch.randn(6, generator=g),
            "one": torch.randn(1, 4, generator=g), "bf": torch.randn(9, 3, generator=g).bfloat16(),
            "i64": torch.arange(11, dtype=torch.int64), "zero_d": torch.tensor(3.5)}


def _save_layouts(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full_tensors()
    place = {"s0": Shard(0), "s1": Shard(1), "s2": Shard(2), "rep": Replicate(), "one": Shard(0), "bf": Shard(0),
             "i64": Shard(0)}
    sd = {k: distribute_tensor(v, mesh, [place[k]]) if k in place else v for k, v in full.items()}
    sd["transposed"] = torch.arange(15.0).view(3, 5).t()  # saved with its strides
    sd["values"] = {"betas": (0.9, 0.95), "name": "x", "params": ["a.b", "c"], "n": 7}
    dcp.save(sd, checkpoint_id=path)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "layouts")
    run_ranks(_save_layouts, 2, path, timeout=120)
    return path


def test_any_layout_by_exact_ranges(layouts):
    md = read_metadata(layouts)
    want = dict(_full_tensors(), transposed=torch.arange(15.0).view(3, 5).t().contiguous())
    for key, full in want.items():
        entry = md.entries[key]
        assert isinstance(entry, TensorEntry) and entry.dtype == full.dtype and entry.size == tuple(full.shape)
        flat, n = full.reshape(-1), full.numel()
        for a, b in {(0, n), (0, 1), (n // 3, n - n // 4), (n - 1, n), (n // 2, n // 2)}:
            dest = torch.full((b - a,), 0, dtype=full.dtype)
            with DcpReader() as r:
                r.queue(entry, a, dest, key)
                r.execute()
                exact = r.bytes_read == r.bytes_needed == (b - a) * full.dtype.itemsize
            assert torch.equal(dest, flat[a:b]), (key, a, b)
            assert exact or key == "transposed", (key, a, b)  # a strided chunk is read whole
    with DcpReader() as r:
        values = {k: r.value(md.entries[f"values.{k}"], k) for k in ("betas", "name", "params", "n")}
    assert values == {"betas": (0.9, 0.95), "name": "x", "params": ["a.b", "c"], "n": 7}


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


def test_metadata_pickle_is_allow_listed(layouts, tmp_path):
    bad = str(tmp_path / "evil")
    shutil.copytree(layouts, bad)
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(UnsafeCheckpointError, match="posix.system, which is not one of DCP's metadata classes"):
        read_metadata(bad)
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match="not a readable DCP metadata file"):
        read_metadata(bad)


def _load_expecting_error(rank, world, path):
    model = fp.shard(make_model(1))
    try:
        fp.load_checkpoint(path, model, groups(model))
    except fp.CheckpointError as e:
        return type(e).__name__, str(e)
    return None


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "src")
    run_ranks(save_run, 2, path, timeout=180)
    return path


def test_damaged_directory_fails_on_every_rank(source, tmp_path):
    trunc = str(tmp_path / "trunc")
    shutil.copytree(source, trunc)
    data = os.path.join(trunc, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) // 2)
    got = run_ranks(_load_expecting_error, 2, trunc, timeout=120)
    assert all(g is not None and g[0] == "CorruptCheckpointError" for g in got), got
    assert "__0_0.distcp" in got[0][1] and "truncated" in got[0][1]

    flipped = str(tmp_path / "flipped")
    shutil.copytree(source, flipped)
    chunk = read_metadata(flipped).entries["model.blocks.0.fc.weight"].chunks[0]
    with open(os.path.join(flipped, chunk.file), "r+b") as f:
        fd = f.fileno()
        h = tensor_header(fd, chunk.offset, chunk.length, "test")
        byte = os.pread(fd, 1, h.data_offset + 5)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), h.data_offset + 5)
    got = run_ranks(_load_expecting_error, 2, flipped, timeout=120)  # same layout: whole chunks, CRC-checked
    assert all(g is not None and g[0] == "CorruptCheckpointError" for g in got), got
    assert "fail their CRC-32 check" in got[0][1] + got[1][1] and "blocks.0.fc.weight" in got[0][1] + got[1][1]

    interrupted = str(tmp_path / "interrupted")
    shutil.copytree(source, interrupted)
    os.remove(os.path.join(interrupted, ".metadata"))
    assert is_dcp_dir(interrupted)
    got = run_ranks(_load_expecting_error, 2, interrupted, timeout=120)
    assert all(g[0] == "IncompleteCheckpointError" and "DCP save" in g[1] for g in got), got


def test_no_general_unpickling_on_load(source, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("pickle/torch.load used on a load path")

    for mod, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(mod, name, refuse)
    model = make_model(3)  # world 1, unsharded: the same reader
    opt = groups(model)
    extra = fp.load_checkpoint(source, model, opt)
    assert extra["extra"]["step"] == 2 and opt.state[model.pos]["step"].item() == 2.0


def test_param_groups_must_hold_the_same_parameters(source):
    model = make_model(3)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}])
    with pytest.raises(CheckpointMismatchError, match=r"param_groups\[0\] \(holds blocks.0.ln1.weight, which"):
        fp.load_checkpoint(source, model, opt)


def test_torchtitan_layout_flat_model_and_flattened_optimizer(tmp_path):
    """Model FQNs at the top level and ``flatten_optimizer_state_dict=True`` (torchtitan), no process group."""
    import torch.distributed.checkpoint as dcp
    from _dcp_source import batch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    src = make_model(0)
    opt = groups(src)
    x, y = batch(0, 0, 1)
    src(x, y).backward()
    opt.step()
    msd, osd = get_state_dict(src, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": osd, "train_state": {"step": 1, "ntokens_seen": 192}}, checkpoint_id=str(tmp_path))
    model = make_model(5)
    mine = groups(model, lr=1.0)
    extra = fp.load_checkpoint(str(tmp_path), model, mine)
    assert extra == {"train_state": {"step": 1, "ntokens_seen": 192}}
    assert mine.param_groups[0]["lr"] == 3e-3 and mine.param_groups[1]["weight_decay"] == 0.0
    for (n, p), q in zip(src.named_parameters(), model.parameters()):
        assert torch.equal(p, q), n
        for k, v in opt.state[p].items():
            assert torch.equal(mine.state[q][k], v), (n, k)
