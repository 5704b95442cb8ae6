"""A dead rank costs a restart, not the run: under ``torchrun --max-restarts`` a SIGKILLed rank makes the
agent restart every worker, each start resumes from ``fp.latest_checkpoint`` (the recipe in
tests/scripts/restart_train.py), and the final weights equal an uninterrupted run's, bit for bit."""
from __future__ import annotations

import os
import random
import subprocess
import time

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
    assert "rank 0 of 2 starts at step 7 from" in out and "step006" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_kill_campaign_random_rank_step_and_saves(tmp_path, uninterrupted, seed):
    rnd = random.Random(seed)
    step = rnd.choice([3, 6, 9]) if seed % 2 else rnd.randint(2, 12)
    kill = f"{rnd.randint(0, 1)}:{step}" + (":save" if seed % 2 else "")
    out = _killed_run_matches(tmp_path, kill, uninterrupted)
    assert out.count("rank 0 of 2 starts at step") >= 2, out[-3000:]     # the agent restarted the workers


@pytest.mark.slow
def test_elastic_restart_on_fewer_nodes_resumes(tmp_path):
    """Two single-process "nodes" (torchrun agents, --nnodes 1:2, c10d rendezvous on localhost); node B and its
    agent die at step 8; node A's agent restarts alone (world 1) and resumes from step006 (resharded to one
    rank; the data of a smaller world differs, so only completion and the resume point are checked)."""
    port = launch.free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "elastic", "--max-restarts", 3, "--monitor-interval", 0.2,
              "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=120"]
    a = launch.torchrun(*common, SCRIPT, tmp_path)                    # first: hosts the rendezvous, survives
    b = launch.torchrun(*common, SCRIPT, tmp_path, "any:8:agent")     # its node dies at step 8
    (rc_a, out_a), (rc_b, out_b) = _staggered([a, b], 3.0, timeout=400)
    assert rc_a == 0, out_a[-3000:]
    assert os.path.exists(os.path.join(tmp_path, "killed")) and rc_b != 0, out_b[-2000:]
    assert "rank 0 of 1 starts at step 7 from" in out_a and "step006" in out_a, out_a[-3000:]
    assert os.path.exists(os.path.join(tmp_path, "final.safetensors"))


def _staggered(commands: list, gap_s: float, timeout: float) -> list:
    """Start the commands ``gap_s`` apart (the first binds the rendezvous endpoint); ``[(returncode, output)]``."""
    env = launch.clean_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    procs = []
    for c in commands:
        procs.append(subprocess.Popen(list(map(str, c)), cwd=launch.ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
        time.sleep(gap_s)
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]
    except subprocess.TimeoutExpired:
        launch.kill_all(procs)
        raise AssertionError(f"elastic run timed out after {timeout:.0f}s") from None
