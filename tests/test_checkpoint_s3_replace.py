"""Replacing a checkpoint on a real S3 API (moto server, s3fs): the manifest PUT carries ``If-Match`` with the ETag
the save read when it began, so of two saves racing to replace one checkpoint exactly one publishes and the other
raises CheckpointError naming the winner; the checkpoint is then wholly the winner's (never a mix), the replaced
save's objects are deleted only after the new manifest is published."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import threading
import time

import pytest
import torch
from _s3 import S3Server, new_bucket
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.checkpoint.errors import CheckpointError
from fsdp_plugin.checkpoint.storage import _publish_remote, remote


@pytest.fixture(scope="module")
def server():
    """moto checks ``If-Match`` and then writes without a lock; S3 does both atomically. The server's PutObject
    is serialized here so that the race below is decided by the condition, as on S3."""
    from moto.s3.responses import S3Response

    real, lock = S3Response.put_object, threading.Lock()

    def atomic_put(self, *a, **k):
        with lock:
            return real(self, *a, **k)

    S3Response.put_object = atomic_put
    s = S3Server().start()
    yield s
    s.stop()
    S3Response.put_object = real


@pytest.fixture
def bucket(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return new_bucket()


def _s3():
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()  # the racers wrote from other processes: no listing cached here may be trusted
    return fs


def _trained(seed: int):
    torch.manual_seed(seed)
    m = fp.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), auto_wrap_policy={nn.Linear})
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def _state(m, opt) -> dict:
    with fp.full_params(m):
        out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.detach().clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def _loaded(path: str) -> dict:
    m, opt = _trained(99)
    fp.load_checkpoint(path, m, opt)
    return _state(m, opt)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _wait_for(paths: list[str], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, f"the other writer never reached the barrier ({paths})"
        time.sleep(0.01)


def _racer(rank, world, path, barrier_dir):
    """Two independent jobs (world 1 each): both read the published manifest when they begin, both upload, and
    both publish at once (a file barrier just before the manifest PUT)."""
    real = _publish_remote.publish

    def at_barrier(*a, **k):
        open(os.path.join(barrier_dir, f"ready{rank}"), "w").close()
        _wait_for([os.path.join(barrier_dir, f"ready{r}") for r in range(world)])
        return real(*a, **k)

    _publish_remote.publish = at_barrier
    m, opt = _trained(10 + rank)
    try:
        fp.save_checkpoint(path, m, opt, extra={"step": 100 + rank})
        outcome = None
    except CheckpointError as e:
        outcome = str(e)
    return os.getpid(), outcome, _state(m, opt)


def _racer_main(rank, world, path, barrier_dir, queue):
    try:   # tensors as lists: a tensor in a queue is a shared-memory handle that dies with this process
        pid, outcome, state = _racer(rank, world, path, barrier_dir)
        queue.put((rank, True, (pid, outcome, {k: (v.tolist(), str(v.dtype)) for k, v in state.items()})))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, False, repr(e)))


def _run_racers(path: str, barrier_dir: str, timeout: float = 300.0) -> list:
    """The two jobs as spawned processes, no process group: clean interpreters (a fork of this process would
    copy the in-process moto server's and s3fs's threads and locks, which once crashed a forked racer)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_racer_main, args=(r, 2, path, barrier_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        end = time.monotonic() + timeout
        while len(got) < 2:
            try:
                rank, ok, payload = queue.get(timeout=max(end - time.monotonic(), 0.1))
            except queue_mod.Empty:
                raise AssertionError(f"racers {sorted(set(range(2)) - set(got))} reported nothing in {timeout:.0f} s "
                                     "(each spawns an interpreter and imports torch: slow under load)") from None
            assert ok, f"racer {rank} failed: {payload}"
            pid, outcome, state = payload
            got[rank] = pid, outcome, {k: torch.tensor(v, dtype=getattr(torch, d.split(".")[1]))
                                       for k, (v, d) in state.items()}
        return [got[0], got[1]]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_two_racing_replacers_exactly_one_wins_the_other_names_it(bucket, tmp_path):
    path = f"{bucket}/ck"
    first = _trained(0)
    fp.save_checkpoint(path, *first, extra={"step": 1})
    old_uid = json.loads(_s3().cat(f"{path}/manifest.json"))["uuid"]
    results = _run_racers(path, str(tmp_path))
    winners = [r for r in results if r[1] is None]
    losers = [r for r in results if r[1] is not None]
    assert len(winners) == 1 and len(losers) == 1, [r[:2] for r in results]
    (win_pid, _, win_state), (_, message, lose_state) = winners[0], losers[0]
    doc = json.loads(_s3().cat(f"{path}/manifest.json"))
    assert doc["writer"]["pid"] == win_pid, (doc["writer"], [r[:2] for r in results])
    assert "another save replaced the checkpoint" in message and old_uid in message, message
    assert doc["uuid"] in message and f"pid {win_pid}" in message and "each its own root" in message, message
    got = _loaded(path)
    assert _same(got, win_state) and not _same(got, lose_state)  # wholly the winner's: never a mix
    assert fp.load_checkpoint(path, _trained(5)[0]) == {"step": doc["extra"]["0"]["step"]}
    # the replaced save's prefix was deleted by the winner (after publishing), the loser removed its own
    assert sorted(k.rsplit("/", 1)[-1] for k in _s3().ls(path)) == sorted([doc["uuid"], "manifest.json"])


def test_a_replace_refuses_a_manifest_changed_since_the_save_began(bucket, monkeypatch):
    """Sequential, deterministic: while save B uploads, save C replaces the checkpoint; B's If-Match fails."""
    path = f"{bucket}/ck"
    fp.save_checkpoint(path, _trained(0)[0], extra={"step": 1})
    real, seen = _publish_remote.publish, {}

    def publish_c_first(tmp, p, data, base):
        if not seen:
            seen["base"] = base
            fp.save_checkpoint(path, _trained(2)[0], extra={"step": 3})  # C: publishes while B is "uploading"
        return real(tmp, p, data, base)

    monkeypatch.setattr(_publish_remote, "publish", publish_c_first)
    with pytest.raises(CheckpointError, match=r"another save replaced .* step 3"):
        fp.save_checkpoint(path, _trained(1)[0], extra={"step": 2})  # B
    assert seen["base"].token  # the ETag B read: its PUT was conditional, server-side
    monkeypatch.undo()
    assert fp.load_checkpoint(path, _trained(5)[0]) == {"step": 3}
    assert len(_s3().ls(path)) == 2  # C's prefix and the manifest


def test_a_retried_manifest_put_that_had_succeeded_is_not_a_conflict(bucket, monkeypatch):
    """The first PUT is applied but its response is lost (connection reset): the retry's If-Match fails with 412
    because the manifest is already ours. The save must succeed, not remove its own published objects."""
    path = f"{bucket}/ck"
    fp.save_checkpoint(path, _trained(0)[0], extra={"step": 1})
    fs = remote.ObjectStorage(path).fs  # the cached client every save uses
    real, calls = fs.pipe_file, []

    def lossy(p, data, **kw):
        calls.append(kw.get("IfMatch"))
        out = real(p, data, **kw)
        if len(calls) == 1 and p.endswith("manifest.json"):
            raise ConnectionResetError("connection reset by peer (the response was lost)")
        return out

    monkeypatch.setattr(fs, "pipe_file", lossy)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    fp.save_checkpoint(path, _trained(1)[0], extra={"step": 2})
    monkeypatch.undo()
    assert len(calls) == 2 and calls[0] and calls[0] == calls[1]  # both attempts conditional on the same ETag
    assert fp.load_checkpoint(path, _trained(5)[0]) == {"step": 2}
    assert len(_s3().ls(path)) == 2
