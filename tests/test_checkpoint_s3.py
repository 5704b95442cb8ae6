"""Checkpoints on a real S3 API (moto server on 127.0.0.1, s3fs client): resharding, crash safety, retries,
corruption, conditional publish. Not a mock of our calls: every byte goes through HTTP to the server."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from _dist import RankFailure, run_ranks
from _s3 import S3Server, new_bucket
from test_checkpoint_reshard import _assert_same_state, _load_run, _save_run
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import verify_checkpoint
from fsdp_plugin.checkpoint.storage import _publish_remote, fsio, remote
from fsdp_plugin.checkpoint.errors import CheckpointError, StorageError


@pytest.fixture(scope="module")
def server():
    s = S3Server().start()
    saved = {k: os.environ.get(k) for k in s.env()}
    yield s
    s.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def bucket(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return new_bucket()


def _s3():
    import s3fs

    return s3fs.S3FileSystem()


def test_save_world2_load_world3_and_1_bit_exact(bucket):
    path = f"{bucket}/run/step2"
    saved = run_ranks(_save_run, 2, path, "full_shard", timeout=120)
    for m in (3, 1):
        loaded = run_ranks(_load_run, m, path, "full_shard", timeout=120)
        _assert_same_state([s for _, s in saved], [s for _, s in loaded])
        ref, got = saved[0][0], loaded[0][0]
        assert max(abs(x - y) for x, y in zip(ref, got)) <= 1e-6  # training resumes identically
    assert fp.latest_checkpoint(f"{bucket}/run") == path


def _big():
    torch.manual_seed(0)
    return fp.shard(nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024)), auto_wrap_policy={nn.Linear})


BLOCK = 64 << 10


def _save_big(rank, world, path):
    fsio.BLOCK_BYTES = BLOCK  # CRC blocks of 64 KiB: a read is widened by less than 2 blocks per piece
    fp.save_checkpoint(path, _big())


def _load_big_counting(rank, world, path):
    from fsdp_plugin._flat.layout import param_shards

    model = _big()
    before = remote.bytes_read
    fp.load_checkpoint(path, model)
    need = sum((sh.end - sh.start) * 4 for sh in param_shards(model))  # fp32 bytes of this rank's pieces
    return need, remote.bytes_read - before


def test_ranged_reads_fetch_only_the_bytes_a_rank_needs(bucket):
    path = f"{bucket}/ck"
    run_ranks(_save_big, 2, path, timeout=120)
    total = sum(r["bytes"] for r in json.loads(_s3().cat(path + "/manifest.json"))["files"].values())
    got = run_ranks(_load_big_counting, 3, path, timeout=120)
    for need, read in got:  # 4 params x <= 2 files each x 2 widening blocks, + headers and the manifest
        assert need <= read <= need + 16 * BLOCK + (64 << 10), (need, read, total)


def _save_then_die(rank, world, path):
    model = _big()
    fp.save_checkpoint(f"{path}/step1", model, extra={"step": 1})
    if rank == 1:  # SIGKILL this rank after 10 MiB of its upload (a multipart upload of 16 MiB parts under way)
        real = remote.ObjectStorage.write_file

        def dying(self, url, body):
            written = [0]

            def wrapped(write, hint):
                def w(view):
                    write(view)
                    written[0] += len(view)
                    if written[0] > 10 << 20:
                        os.kill(os.getpid(), signal.SIGKILL)
                return body(w, hint)
            return real(self, url, wrapped)

        remote.ObjectStorage.write_file = dying
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fp.save_checkpoint(f"{path}/step2", model, extra={"step": 2})


def _load_step(rank, world, path):
    model = _big()
    extra = fp.load_checkpoint(path, model)
    return extra, fp.full_state_dict(model)


def test_sigkill_of_one_rank_mid_upload_leaves_the_previous_checkpoint(bucket):
    root = f"{bucket}/run"
    with pytest.raises(RankFailure):
        run_ranks(_save_then_die, 2, root, timeout=60, env={"FSDP_PLUGIN_TIMEOUT_S": "5"}, may_die=(1,))
    assert fp.latest_checkpoint(root) == f"{root}/step1"
    assert not _s3().exists(f"{root}/step2/manifest.json")
    assert _s3().find(f"{root}/step2") == [] or all("rank" in k for k in _s3().find(f"{root}/step2"))
    (extra, full), = run_ranks(_load_step, 1, f"{root}/step1", timeout=60)
    assert extra == {"step": 1}
    ref = _big()
    with fp.full_params(ref):
        for k, v in ref.state_dict().items():
            assert torch.equal(full[k], v), k
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        fp.load_checkpoint(f"{root}/step2", _big())


def _small():
    torch.manual_seed(0)
    return fp.shard(nn.Sequential(nn.Linear(8, 8)))


def test_server_restarted_during_a_save_is_retried(bucket, server, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.3)  # 0.3 + 0.6 + 1.2 + 2.4 s of backoff: the restart fits
    fp.save_checkpoint(f"{bucket}/run/step1", _small(), extra={"step": 1})
    server.stop()
    threading.Timer(1.0, server.start).start()
    fp.save_checkpoint(f"{bucket}/run/step2", _small(), extra={"step": 2})  # first requests fail, retried
    assert fp.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/step2"
    assert fp.load_checkpoint(f"{bucket}/run/step2", _small()) == {"step": 2}


def test_server_down_names_the_operation_and_keeps_the_previous_checkpoint(bucket, server, monkeypatch):
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)
    fp.save_checkpoint(f"{bucket}/run/step1", _small(), extra={"step": 1})
    server.stop()
    t0 = time.monotonic()
    try:
        with pytest.raises(StorageError, match=r"failed 3 times.*connect") as e:
            fp.save_checkpoint(f"{bucket}/run/step2", _small(), extra={"step": 2})
        assert bucket in str(e.value) and time.monotonic() - t0 < 30
    finally:
        server.start()
    assert fp.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/step1"
    assert fp.load_checkpoint(f"{bucket}/run/step1", _small()) == {"step": 1}


def _load_report(rank, world, path):
    try:
        fp.load_checkpoint(path, _big())
    except CheckpointError as e:
        return type(e).__name__, str(e)
    return None


def test_corrupted_object_is_detected_on_every_rank(bucket):
    path = f"{bucket}/ck"
    run_ranks(lambda r, w: fp.save_checkpoint(path, _big()), 2, timeout=60)
    fs = _s3()
    uid = json.loads(fs.cat(path + "/manifest.json"))["uuid"]
    obj = f"{path}/{uid}/rank00000.model.safetensors"
    data = bytearray(fs.cat(obj))
    data[len(data) // 2] ^= 0x01
    fs.pipe(obj, bytes(data))
    reports = run_ranks(_load_report, 2, path, timeout=60)
    assert all(r is not None and "CRC32" in r[1] and "rank00000.model" in r[1] for r in reports), reports
    assert verify_checkpoint(path)


def test_conditional_publish_one_of_two_racing_writers_wins(bucket, monkeypatch):
    path = f"{bucket}/ck"
    fp.save_checkpoint(path, _small(), extra={"w": "A"})
    fs = _s3()
    with pytest.raises(FileExistsError):  # the server enforces If-None-Match
        remote.ObjectStorage(path).create_exclusive(path + "/manifest.json", b"{}", exclusive=True)
    # writer B read "no manifest yet" before A published (the race window), then tries to publish
    monkeypatch.setattr(_publish_remote, "read_base", lambda p: None)
    with pytest.raises(CheckpointError, match="another save published"):
        fp.save_checkpoint(path, _small(), extra={"w": "B"})
    monkeypatch.undo()
    assert fp.load_checkpoint(path, _small()) == {"w": "A"}
    uid = json.loads(fs.cat(path + "/manifest.json"))["uuid"]
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.ls(path)) == sorted([uid, "manifest.json"])


def test_async_save_and_latest(bucket):
    m = _small()
    h = fp.save_checkpoint(f"{bucket}/run/step5", m, extra={"step": 5}, async_save=True)
    h.wait()
    assert fp.latest_checkpoint(f"{bucket}/run") == f"{bucket}/run/step5"
    assert fp.load_checkpoint(f"{bucket}/run/step5", _small()) == {"step": 5}


def _export_hf(rank, world, url):
    model = _big()
    fp.save_pretrained(model, url, max_shard_size="20MB")
    sd = fp.full_state_dict(model)  # collective
    return sd if rank == 0 else None


def test_save_pretrained_at_world_2_to_a_bucket(bucket):
    url = f"{bucket}/hf"
    want = run_ranks(_export_hf, 2, url, timeout=120)[0]
    names = sorted(k.rsplit("/", 1)[-1] for k in _s3().ls(url))
    assert "model.safetensors.index.json" in names and len(names) >= 3, names
    m = _big()
    assert not fp.load_pretrained(m, url)  # ranged reads from the bucket
    with fp.full_params(m):
        for k, v in m.state_dict().items():
            assert torch.equal(v, want[k]), k


def _dcp_load_counting(rank, world, url):
    from fsdp_plugin.checkpoint.dcp import load_dcp

    model = _big()
    before = remote.bytes_read
    load_dcp(url, model)
    read = remote.bytes_read - before
    return fp.full_state_dict(model), read  # collective: rank 0 gets the tensors


def test_dcp_export_to_a_bucket_and_import_at_world_2_with_ranged_reads(bucket):
    """export_dcp URL -> URL (built locally, uploaded, .metadata last); load_dcp from the bucket at world 2: each
    rank reads its own byte ranges (about half the data), and the model is the saved one bit for bit."""
    from fsdp_plugin.checkpoint.dcp import export_dcp

    path, out = f"{bucket}/ck", f"{bucket}/dcp"
    run_ranks(lambda r, w: fp.save_checkpoint(path, _big()), 2, timeout=120)
    export_dcp(path, out)
    names = sorted(k.rsplit("/", 1)[-1] for k in _s3().ls(out))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"], names
    total = sum(_s3().size(f"{out}/{n}") for n in names)
    got = run_ranks(_dcp_load_counting, 2, out, timeout=120)
    want = _big()
    with fp.full_params(want):
        for k, v in want.state_dict().items():
            assert torch.equal(got[0][0][k], v), k
    for _, read in got:  # its half of the 4 Mi fp32 elements, plus the items' zip headers and .metadata
        assert 0.4 * total < read < 0.6 * total, (read, total)
