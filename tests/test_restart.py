"""A dead rank costs a restart, not the run: under ``torchrun --max-restarts`` a SIGKILLed rank makes the
agent restart every worker, each start resumes from ``fp.latest_checkpoint`` (the recipe in
tests/scripts/restart_train.py), and the final weights equal an uninterrupted run's, bit for bit."""
from __future__ import annotations

import os
import random

import pytest
from safetensors.torch import load_file

import _launch as launch

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "restart_train.py")


def _torchrun(root, kill: str = "") -> str:
    os.makedirs(root, exist_ok=True)
    args = launch.torchrun("--standalone", "--nproc-per-node", 2, "--max-restarts", 2, "--monitor-interval", 0.2,
                           SCRIPT, root, *([kill] if kill else []))
    # A fresh worker store per attempt: with torchrun's shared agent store (the default), restarted gloo workers
    # can read the dead attempt's addresses and hang in connectFullMesh (measured here, torch 2.13).
    return launch.run(args, timeout=400, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _weights(root) -> dict:
    return load_file(os.path.join(root, "final.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    _torchrun(root)
    return _weights(root)


def _killed_run_matches(root, kill: str, want: dict) -> str:
    out = _torchrun(root, kill)
    assert os.path.exists(os.path.join(root, "killed")), out          # the fault did happen
    got = _weights(root)
    assert set(got) == set(want)
    diff = {k: (got[k] - want[k]).abs().max().item() for k in want if not (got[k] == want[k]).all()}
    assert not diff, diff
    return out


def test_a_killed_rank_restarts_and_resumes_from_the_last_complete_checkpoint(tmp_path, uninterrupted):
    out = _killed_run_matches(tmp_path, "1:8", uninterrupted)
    assert "rank 0 starts at step 7 from" in out and "step006" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_kill_campaign_random_rank_step_and_saves(tmp_path, uninterrupted, seed):
    rnd = random.Random(seed)
    step = rnd.choice([3, 6, 9]) if seed % 2 else rnd.randint(2, 12)
    kill = f"{rnd.randint(0, 1)}:{step}" + (":save" if seed % 2 else "")
    out = _killed_run_matches(tmp_path, kill, uninterrupted)
    assert out.count("rank 0 starts at step") >= 2, out[-3000:]     # the agent restarted the workers
