"""Async checkpoints reached through the integrations' usual switches (world 1, in process, no launcher):
Accelerate ``save_state(async_save=True)``, Lightning ``AsyncCheckpointIO`` / ``FSDPPluginStrategy(async_save=)``."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_plugin as fp


@pytest.fixture
def fresh_accelerate(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.setenv(name, "false" if name != "ACCELERATE_MIXED_PRECISION" else "no")
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))


def _step(model, opt):
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", [True, "deferred"])
def test_accelerate_save_state_async(tmp_path, fresh_accelerate, mode):
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator(sharding_config=fp.ShardingConfig())
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _step(model, opt)
    acc.save_state(tmp_path / "s", async_save=mode)
    assert isinstance(acc.pending_checkpoint, fp.AsyncSave)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    _step(model, opt)  # training goes on while the state is written
    assert any(not torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters())
    acc.load_state(tmp_path / "s")  # waits for the pending save
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), expected[n]), n


def test_lightning_strategy_async_switches(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from fsdp_plugin.integrations import _pending_save as pending_save
    from fsdp_plugin.integrations.lightning.checkpoint import async_save as _async_save
    from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy

    assert _async_save.requested(FSDPPluginStrategy()) is False
    assert _async_save.requested(FSDPPluginStrategy(checkpoint_io=AsyncCheckpointIO())) is True
    strategy = FSDPPluginStrategy(async_save="deferred")
    assert _async_save.requested(strategy) == "deferred"
    with pytest.raises(ValueError, match="async_save"):
        FSDPPluginStrategy(async_save="later")
    model = _net()
    tracker = pending_save.of(strategy)
    handle = tracker.start(lambda: ckpt.save_sharded(Path(tmp_path / "c"), model, [], ckpt.encode_meta({"epoch": 3}),
                                                     async_save=True))
    assert tracker.handle is handle and strategy.async_saves == 1
    tracker.wait()
    assert handle.done() and tracker.handle is None
    assert ckpt.load_sharded(Path(tmp_path / "c"), _net(), [])["epoch"] == 3


def test_pending_save_waits_for_the_previous_and_surfaces_its_failure():
    from fsdp_plugin.integrations._pending_save import PendingSave

    class Handle:
        def __init__(self, log, name, fail=False):
            self.log, self.name, self.fail = log, name, fail

        def wait(self):
            self.log.append(f"wait {self.name}")
            if self.fail:
                raise OSError(f"{self.name} failed")

    log, tracker = [], PendingSave()
    tracker.start(lambda: log.append("start a") or Handle(log, "a"))
    tracker.start(lambda: log.append("start b") or Handle(log, "b", fail=True))
    with pytest.raises(OSError, match="b failed"):  # the next save waits for b first: its failure surfaces
        tracker.start(lambda: log.append("start c"))
    assert log == ["start a", "wait a", "start b", "wait b"] and tracker.handle is None
    assert tracker.start(lambda: log.append("sync c")) is None and tracker.started == 2
    tracker.wait()  # teardown with nothing pending
    assert log[-1] == "sync c"

