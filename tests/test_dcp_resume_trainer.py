"""``Trainer.train(resume_from_checkpoint=<stock FSDP checkpoint-N>)`` after the one-line import.

A stock FSDP Trainer needs a GPU (accelerate selects FSDP only for GPU distributed types), so the source is
the stock single-process Trainer on CPU with its checkpoints rewritten to the stock FSDP
``SHARDED_STATE_DICT`` layout (``pytorch_model_fsdp_0/`` + ``optimizer_0/`` DCP, ``scheduler.pt``,
``trainer_state.json``, ``rng_state.pth``; see ``hf_trainer_check.phase_stock_fsdp``). Ours resumes it at 1
and 2 processes with the stock run's losses (≤ 1e-6) and learning rates."""
from __future__ import annotations

import sys

import pytest
from _launch import run

pytest.importorskip("transformers")
from test_hf_trainer import ROOT, SCRIPT, accelerate, after, report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    out = tmp_path_factory.mktemp("stock_fsdp")
    run([sys.executable, str(SCRIPT), out, "stock_fsdp"], timeout=240, cwd=ROOT)
    rep = report(out, "stock_fsdp")
    assert not rep["engine"]
    assert rep["ckpt3"] == ["optimizer_0", "pytorch_model_fsdp_0", "rng_state.pth", "scheduler.pt",
                            "trainer_state.json"]
    return out, rep["hist"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_from_stock_fsdp_checkpoint(stock, tmp_path, nproc):
    src, want = stock
    accelerate(SCRIPT, [tmp_path, "resume", src / "checkpoint-3"], nproc=nproc)
    got = report(tmp_path, "resume")
    assert got["engine"]
    losses, ref = after(got["resumed"], 3), after(want, 3)
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-6, (losses, ref)
    assert after(got["resumed"], 3, "lr") == after(want, 3, "lr")  # scheduler.pt restored
