"""Lightning: configure_optimizers returning [fp.optim.Muon, AdamW] trains on 2 devices and resumes exactly."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch

pytest.importorskip("lightning")


def test_muon_and_adamw_train_and_resume(tmp_path):
    full, resumed = tmp_path / "full.json", tmp_path / "resumed.json"
    launch.python("lightning_muon.py", "--out", full, "--ckpt-dir", tmp_path / "ck", timeout=300)
    first = launch.report(full)
    assert first["exchanges"] > 0, "a.weight is cut between the 2 ranks: Muon's owner exchange ran"
    assert first["shapes"]["a.weight"][1:] == [8]    # pieces keep their ndim: (k, 8)
    ckpt = next((tmp_path / "ck").glob("epoch=0*"))
    launch.python("lightning_muon.py", "--out", resumed, "--ckpt-dir", tmp_path / "ck2", "--resume", ckpt,
                  timeout=300)
    again = launch.report(resumed)
    want = [l for l in first["losses"] if l[0] == 1]
    assert [l for l in again["losses"] if l[0] == 1] == want and len(want) == 2
