"""``Trainer(strategy="fsdp_plugin").fit(ckpt_path=<Lightning FSDPStrategy sharded checkpoint>)``: the
checkpoint is written by Lightning's own FSDPStrategy (FSDP1 on CPU, see ``lightning_train.stock_fsdp_strategy``)
and resumed on our strategy at 1 and 2 devices with the stock run's losses (≤ 1e-6) and LR schedule."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch

pytest.importorskip("lightning")
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("stock_fsdp")
    launch.python("lightning_train.py", "--out", d / "out.json", "--strategy", "stock_fsdp", "--devices", 2,
                  "--save-at", 4, d / "step4.ckpt", timeout=240)
    assert sorted(p.name for p in (d / "step4.ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                  "meta.pt"]
    return {"dir": d, "report": launch.report(d / "out.json")}


@pytest.mark.parametrize("devices", [1, 2])
def test_fit_resumes_a_stock_fsdp_sharded_checkpoint(stock, devices):
    out = stock["dir"] / f"ours{devices}.json"
    launch.python("lightning_train.py", "--out", out, "--devices", devices, "--resume",
                  stock["dir"] / "step4.ckpt", timeout=240)
    got, want = launch.report(out), stock["report"]
    assert got["strategy"] == "FSDPPluginStrategy" and got["world_size"] == devices
    assert [e[0] for e in got["losses"]] == [5, 6, 7, 8]
    want_after = [e for e in want["losses"] if e[0] > 4]
    assert max(abs(a[1] - b[1]) for a, b in zip(got["losses"], want_after)) <= 1e-6, (got["losses"], want_after)
    assert [e[2] for e in got["losses"]] == [e[2] for e in want_after]  # StepLR restored from meta.pt
