"""Asynchronous checkpoint saves: the files hold the values at the call while training goes on; failures
surface in ``wait()``; a pending save is waited for by the next save and by process exit."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _dist import run_ranks
from models import GPT, Block

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from fsdp_plugin.checkpoint.asyncsave import _async
from fsdp_plugin.checkpoint import save as save_mod

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _sharded(seed):
    torch.manual_seed(seed)
    model = GPT(vocab=256, d=32, n_layer=2, seq=16)
    return fp.shard(model, sharding_strategy="full_shard", auto_wrap_policy={Block})


def _step(model, opt, rank, i):
    g = torch.Generator().manual_seed(100 * i + rank)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    states = [opt.state[p][k].clone() for p in model.parameters() for k in sorted(opt.state[p])]
    return params, states


def _slow_fsync(delay):
    real = os.fsync

    def fsync(fd):
        import time

        time.sleep(delay)
        real(fd)

    os.fsync = fsync  # this forked rank only: keeps the background write busy while training runs
    return lambda: setattr(os, "fsync", real)


def _train_while_saving(rank, world, path, mode):
    restore = _slow_fsync(0.3)
    if mode == "deferred":  # a late copy: without the optimizer-step fence the steps below would win the race
        real_copy = _async.Stager.copy_deferred

        def late_copy(self):
            import time

            time.sleep(0.3)
            real_copy(self)

        _async.Stager.copy_deferred = late_copy
    model = _sharded(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, 0)
    snap = _state(model, opt)
    h = save_checkpoint(path, model, opt, extra={"step": 1, "t": torch.full((2,), float(rank))}, async_save=mode)
    assert isinstance(h, fp.AsyncSave)
    for i in range(1, 4):  # training (and its collectives on the default group) runs during the write
        _step(model, opt, rank, i)
    overlapped = not h.done()
    h.wait()
    restore()
    assert h.done()
    h2 = save_checkpoint(path + "2", model, opt, async_save=True)
    after = _state(model, opt)
    save_checkpoint(path + "3", model, opt, async_save=True)  # waits for h2 first
    assert h2.done()
    m2 = _sharded(1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    extra = load_checkpoint(path, m2, o2)  # waits for the pending third save
    got = _state(m2, o2)
    m3 = _sharded(2)
    o3 = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    load_checkpoint(path + "2", m3, o3)
    return snap, got, extra, after, _state(m3, o3), overlapped


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("mode", [True, "deferred"])
def test_async_save_holds_values_at_call_while_training(tmp_path, mode):
    """deferred: the copy is made on the checkpoint thread; the optimizer steps wait for it."""
    path = str(tmp_path / "ck")
    out = run_ranks(_train_while_saving, 2, path, mode, timeout=120)
    assert any(o[-1] for o in out), "no training step ran during the background write: the test cannot fail"
    for rank, (snap, got, extra, after, got2, _) in enumerate(out):
        assert _same(snap[0], got[0]) and _same(snap[1], got[1]), "async checkpoint does not hold the call's values"
        assert not _same(snap[0], after[0]), "training did not change the parameters: the test cannot fail"
        assert _same(after[0], got2[0]) and _same(after[1], got2[1])
        assert extra["step"] == 1 and torch.equal(extra["t"], torch.full((2,), float(rank)))
    assert verify_checkpoint(path) == [] and verify_checkpoint(path + "3") == []


def test_async_failure_reraised_in_wait_and_previous_kept(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    model = torch.nn.Linear(4, 3)
    save_checkpoint(path, model, extra={"v": 1})

    def boom(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(save_mod, "write_safetensors", boom)
    with torch.no_grad():
        model.weight.fill_(5)
    h = save_checkpoint(path, model, extra={"v": 2}, async_save=True)
    with pytest.raises(OSError, match="disk full"):
        h.wait()
    assert h.done() and "failed" in repr(h)
    assert load_checkpoint(path, torch.nn.Linear(4, 3))["v"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary directory was removed
    h = save_checkpoint(path, model, extra={"v": 3}, async_save=True)
    monkeypatch.undo()
    with pytest.raises(OSError, match="disk full"):  # never waited for: the next save re-raises it
        save_checkpoint(path, model, extra={"v": 4})
    save_checkpoint(path, model, extra={"v": 4})
    assert load_checkpoint(path, torch.nn.Linear(4, 3))["v"] == 4
    assert _async._pending is None


def test_exit_finishes_pending_save(tmp_path):
    """A script that returns right after an async save still publishes a complete checkpoint."""
    path = str(tmp_path / "ck")
    code = textwrap.dedent(f"""
        import torch
        import os
        from fsdp_plugin.checkpoint import save_checkpoint
        real = os.fsync
        def slow_fsync(fd):
            import time; time.sleep(0.5); real(fd)
        os.fsync = slow_fsync  # every file of the save is fsynced through os.fsync
        m = torch.nn.Linear(64, 64)
        torch.nn.init.constant_(m.weight, 2.0)
        h = save_checkpoint({path!r}, m, extra={{"v": 9}}, async_save=True)
        assert not h.done()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    m = torch.nn.Linear(64, 64)
    assert load_checkpoint(path, m)["v"] == 9 and torch.all(m.weight == 2.0)
    assert verify_checkpoint(path) == []


def _slowed_write(monkeypatch, delay=1.0):
    """The background write starts ``delay`` s late: changes made right after the call win any race (1 s: the
    call returns and the test acts well within it even on a loaded 2-core CI machine running 3 xdist workers)."""
    import time

    real = save_mod.write_safetensors
    monkeypatch.setattr(save_mod, "write_safetensors", lambda *a, **k: (time.sleep(delay), real(*a, **k))[1])


def test_staging_buffers_reused_and_each_save_holds_its_calls_values(tmp_path, monkeypatch):
    """Saves of one model reuse its staging buffers; in-place changes right after each call (outside any
    optimizer step, while the write is pending) never reach that call's files."""
    _slowed_write(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    snaps, ptrs = [], []
    for k in range(3):
        snaps.append([p.detach().clone() for p in model.parameters()])
        h = save_checkpoint(str(tmp_path / f"ck{k}"), model, async_save=True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert not h.done(), "the write finished before the change: the test cannot fail"
        h.wait()
        ptrs.append(sorted(t.data_ptr() for ts in _async._pools[model].values() for t in ts))
    assert ptrs[0] == ptrs[1] == ptrs[2], "the staging buffers were not reused"
    for k, snap in enumerate(snaps):
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        load_checkpoint(str(tmp_path / f"ck{k}"), m)
        assert _same([p.detach() for p in m.parameters()], snap), f"save {k} does not hold its call's values"
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert _async.release_staging_buffers(model) == nbytes and model not in _async._pools


def test_staging_buffers_released_by_call_pending_save_and_gc(tmp_path, monkeypatch):
    import gc
    import weakref

    from fsdp_plugin.checkpoint import release_staging_buffers

    gc.collect()
    release_staging_buffers()    # buffers an earlier test's finished saves left in the pool are not this test's
    _slowed_write(monkeypatch)
    model = torch.nn.Linear(32, 32)
    h = save_checkpoint(str(tmp_path / "a"), model, async_save=True)
    assert release_staging_buffers() == 0  # pending: its buffers are freed when it finishes, not re-pooled
    h.wait()
    assert model not in _async._pools
    save_checkpoint(str(tmp_path / "b"), model, async_save=True).wait()
    assert model in _async._pools
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and len(_async._pools) == 0, "the staging buffers outlived their model"
