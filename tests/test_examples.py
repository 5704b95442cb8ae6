"""The example scripts, run the way a user runs them: real torchrun, 2 ranks, in a subprocess."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import fsdp_plugin as fp
import _readme
from _launch import run, torchrun

ROOT = Path(__file__).resolve().parents[1]
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"
STEP_RE = re.compile(r"^step\s+(\d+) \| loss ([0-9.]+)", re.M)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not hasattr(fp, "shard"), reason="engine (fp.shard) not available yet"),
]

# small and fast: ~0.1 M parameters, a couple of seconds of training per run on 2 cores
SMALL = ["--dim", "64", "--layers", "2", "--heads", "2", "--batch", "8", "--seq", "64",
         "--lr", "3e-3", "--warmup", "5", "--log-every", "10", "--eval-batches", "1"]


def _torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> str:
    cmd = torchrun("--standalone", f"--nproc_per_node={nproc}", TRAIN_GPT, *args)
    return run(cmd, timeout=timeout, env={"PYTHONPATH": str(ROOT)})  # this tree, not an installed copy


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in STEP_RE.findall(out)}


@pytest.fixture(scope="module")
def straight_run() -> str:
    """One uninterrupted 30-step run, shared by the tests below."""
    return _torchrun(*SMALL, "--steps", "30")


def test_train_gpt_loss_falls(straight_run):
    losses = _losses(straight_run)
    tail = straight_run[-3000:]
    assert sorted(losses) == [1, 10, 20, 30], tail
    assert losses[1] > 5.0, tail  # ~ln(256) = 5.55 at init
    assert losses[30] < losses[1] - 1.5, tail
    assert re.search(r"memory rank 1: live parameters", straight_run), tail
    assert "held-out loss" in straight_run, tail


def _have_checkpoints() -> bool:
    try:
        import fsdp_plugin.checkpoint as ckpt
    except ImportError:
        ckpt = None
    return all(hasattr(fp, n) or hasattr(ckpt, n) for n in ("save_checkpoint", "load_checkpoint"))


@pytest.mark.skipif(not _have_checkpoints(), reason="fp.save_checkpoint / fp.load_checkpoint not available yet")
def test_train_gpt_readme_pair_resumes_exactly(straight_run, tmp_path):
    """The README's torchrun pair (steps 200 then 300, here 20 then 30, with SMALL appended): the second
    resumes at step 20 and trains exactly the uninterrupted run's steps 21..30."""
    first, second = _readme.find(r"^torchrun .*examples/train_gpt\.py --steps")
    assert "--save /tmp/fsdp_demo" in first and "--resume /tmp/fsdp_demo" in second, (first, second)
    ckpt = tmp_path / "fsdp_demo"
    straight = _losses(straight_run)
    out = _readme_run(first, tmp_path)
    assert (ckpt / "manifest.json").is_file() and f"saved sharded checkpoint to {ckpt} at step 20" in out, out[-3000:]
    out = _readme_run(second, tmp_path)
    assert f"resumed from {ckpt} at step 20" in out and "trained 10 steps" in out, out[-3000:]
    resumed = _losses(out)
    assert sorted(resumed) == [21, 30], resumed  # logs the first step trained and the last
    # the same batches, the same restored parameters and AdamW state: the same losses
    assert resumed[30] == pytest.approx(straight[30], abs=1e-5), (straight, resumed)
    # the first command's total again, as a world of one (no torchrun): nothing left, and it says so
    out = run([sys.executable, TRAIN_GPT, *SMALL, "--steps", "20", "--resume", ckpt, "--eval-batches", "0"],
              timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert "nothing left to train: the checkpoint is at step 20 and --steps 20 is the total" in out, out[-3000:]
    assert not _losses(out), out[-3000:]


def _readme_run(command: str, tmp: Path) -> str:
    return run(_readme.argv(command, tmp, SMALL), timeout=240, cwd=_readme.workdir(tmp), env={"PYTHONPATH": str(ROOT)})
