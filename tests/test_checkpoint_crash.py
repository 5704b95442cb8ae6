"""Crash safety: a save killed (SIGKILL) at any point leaves the previous checkpoint loadable, and never a
half-written one that passes for whole."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch
from _dist import RankFailure, run_ranks
from torch import nn

from fsdp_plugin.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from fsdp_plugin.checkpoint.storage import _publish
from fsdp_plugin.checkpoint import save as save_mod


def _model():
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # ~4 MB of fp32


def _fill(model, v):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)


def _saver(path, start, exchange, async_save=False):
    if not exchange:
        _publish._exchange = lambda a, b: False
    torch.set_num_threads(1)
    model, opt = _model(), None
    v = start
    while True:
        _fill(model, v)
        save_checkpoint(path, model, opt, extra={"v": v}, async_save=async_save)  # async: refilled while written
        v += 1


def _check_consistent(path):
    model = _model()
    v = load_checkpoint(path, model)["v"]
    assert all(torch.all(p == v) for p in model.parameters()), f"mixed versions around v={v}"
    assert verify_checkpoint(path) == []
    return v


def _kill_trial(tmp_path, seed, exchange, async_save=False):
    path = str(tmp_path / "ck")
    if not os.path.exists(path):
        m = _model()
        _fill(m, 0)
        save_checkpoint(path, m, extra={"v": 0})
    before = _check_consistent(path)
    proc = mp.get_context("fork").Process(target=_saver, args=(path, before + 1, exchange, async_save))
    proc.start()
    time.sleep(random.Random(seed).uniform(0.0, 0.6))
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    try:
        after = _check_consistent(path)
    except CheckpointError as e:  # only possible without RENAME_EXCHANGE: between the two renames
        assert not exchange and ".old-" in str(e), e
        old = str(e).split(" is a complete checkpoint")[0].split("but ")[-1]
        os.rename(old, path)
        after = _check_consistent(path)
    assert after >= before
    return after


@pytest.mark.parametrize("exchange,async_save", [(True, False), (False, False), (True, True)])
def test_sigkill_during_saves(tmp_path, exchange, async_save):
    """async_save: the kill lands during background writes and publishes (the saver never waits)."""
    versions = [_kill_trial(tmp_path, seed, exchange, async_save) for seed in range(3 if exchange else 2)]
    m = _model()
    _fill(m, -1)
    save_checkpoint(tmp_path / "ck", m, extra={"v": -1})  # the next save cleans every leftover
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert _check_consistent(tmp_path / "ck") == -1
    assert versions == sorted(versions)


@pytest.mark.slow
def test_sigkill_campaign(tmp_path):
    """60 saves SIGKILLed at random points: the previous checkpoint always loads, bit-identical."""
    for seed in range(60):
        _kill_trial(tmp_path, 1000 + seed, exchange=seed % 4 != 0, async_save=seed % 2 == 1)


def _die_mid_write(rank, world, path):
    model = _model()
    _fill(model, 7)
    if rank == 1:
        real = save_mod.write_safetensors

        def write_then_die(*a, **k):
            rec = real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return rec

        save_mod.write_safetensors = write_then_die
    save_checkpoint(path, model, extra={"v": 7, "rng": torch.get_rng_state()})  # rank 1 writes its extra file


def test_rank_killed_mid_save_leaves_previous(tmp_path):
    path = str(tmp_path / "ck")
    m = _model()
    _fill(m, 3)
    save_checkpoint(path, m, extra={"v": 3})
    with pytest.raises(RankFailure):
        run_ranks(_die_mid_write, 2, path, timeout=60)
    assert _check_consistent(path) == 3
