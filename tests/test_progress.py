"""Progress stays readable: a bar on a terminal, a few whole lines (start, every 10%, end) anywhere else;
long library operations (load_pretrained, fp.shard, calibrate) report the same way."""
from __future__ import annotations

import io
import logging

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin import _progress
from fsdp_plugin.cli import main as cli


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_gets_eleven_whole_lines():
    out = io.StringIO()
    p = _progress.Progress("verify", out)
    for done in range(0, 10**9 + 1, 7 * 10**6):
        p(done, 10**9)
    p(10**9, 10**9)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 11, lines
    assert lines[0] == "verify: started, 0 B/1.0 GB" and lines[-1].startswith("verify: done, 1.0 GB/1.0 GB, ")
    assert [ln.split(",")[0] for ln in lines[1:-1]] == [f"verify: {10 * k}%" for k in range(1, 10)]
    assert all(ln.endswith(" s") and "B/s, " in ln for ln in lines[1:]), lines  # size, rate, elapsed


def test_terminal_gets_the_bar():
    out = Terminal()
    p = _progress.Progress("verify", out)
    p(0, 10)
    p(10, 10)
    assert out.getvalue().startswith("\rverify [") and out.getvalue().endswith("\n")


def test_cli_progress_in_a_log_is_lines(tmp_path, capsys):
    model = nn.Linear(64, 64)
    fp.save_checkpoint(tmp_path / "ck", model)
    assert cli(["verify", str(tmp_path / "ck")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines()[0].startswith("verify: started, 0 B/") and "verify: done" in err, err


def test_library_progress_goes_to_the_log_for_large_work_only(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="fsdp_plugin")
    assert _progress.logged("x", _progress.LOG_MIN_BYTES - 1) is None
    assert _progress.logged("x", _progress.LOG_MIN_BYTES) is not None
    caplog.set_level(logging.WARNING, logger="fsdp_plugin")
    assert _progress.logged("x", _progress.LOG_MIN_BYTES) is None  # INFO off: silent


def test_load_pretrained_and_shard_report(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(_progress, "LOG_MIN_BYTES", 0)  # a small model stands in for a large one
    caplog.set_level(logging.INFO, logger="fsdp_plugin")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    fresh = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    fp.load_pretrained(fresh, tmp_path)
    torch.testing.assert_close(fresh[0].weight, model[0].weight)
    fp.shard(fresh, auto_wrap_policy={nn.Linear})
    messages = [r.getMessage() for r in caplog.records]
    for label in (f"load_pretrained {tmp_path}", "fp.shard"):
        mine = [m for m in messages if m.startswith(label + ":")]
        assert mine[0].startswith(f"{label}: started") and mine[-1].startswith(f"{label}: done"), messages


def test_calibrate_reports_each_measurement():
    pytest.importorskip("fsdp_plugin.planner._time")
    from fsdp_plugin.planner._time import calibrate

    out = io.StringIO()
    calibrate(seconds=0.01, progress=_progress.Progress("calibrate", out, unit="measurements"))
    lines = out.getvalue().splitlines()
    assert lines[0] == "calibrate: started, 0/3 measurements" and lines[-1].startswith("calibrate: done, 3/3"), lines


def test_plan_calibrate_shows_progress_on_stderr(capsys, monkeypatch):
    from fsdp_plugin.planner import api

    def fake(device, dtype, progress=None, layer=None):  # the wiring only: the real measurements are timed above
        for done in range(4):
            progress(done, 3)
        return "calibration"
    monkeypatch.setattr(api, "calibrate", fake)
    assert api._calibration("calibrate", torch.device("cpu"), None) == "calibration"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "plan --calibrate: started, 0/3 measurements" and err[-1].startswith("plan --calibrate: done"), err


def test_load_from_several_files_counts_every_byte(tmp_path, caplog, monkeypatch):
    import json

    monkeypatch.setattr(_progress, "LOG_MIN_BYTES", 0)
    caplog.set_level(logging.INFO, logger="fsdp_plugin")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    weight_map = {}
    for i in range(4):  # one file per layer: the reader's threads read them side by side
        part = {k: v for k, v in state.items() if k.startswith(f"{i}.")}
        save_file(part, tmp_path / f"part{i}.safetensors")
        weight_map.update({k: f"part{i}.safetensors" for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    fresh = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    fp.load_pretrained(fresh, tmp_path)
    total = sum(v.numel() * 4 for v in state.values())
    done = [r.getMessage() for r in caplog.records if ": done, " in r.getMessage()]
    assert len(done) == 1 and f"done, {total / 1e3:,.1f} kB/{total / 1e3:,.1f} kB" in done[0], done
