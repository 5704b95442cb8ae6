"""A run SIGKILLed at a random step and resumed from its last checkpoint reproduces the uninterrupted
run's losses exactly (bit for bit)."""
import os
import random
import signal

import pytest
import torch

import fsdp_plugin as fp
from _dist import RankFailure, run_ranks
from _parity import train
from models import GPT, Block, gpt_batch

STEPS, EVERY = 16, 4


def _train(rank, world, root, kill_at, resume):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if resume:
        last = sorted(os.listdir(root))[-1]
        start = fp.load_checkpoint(os.path.join(root, last), model, opt)["step"]
    def batch(step, r):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return gpt_batch(step, r)

    def after(step, loss):
        if root and step % EVERY == 0:
            fp.save_checkpoint(os.path.join(root, f"step{step:03d}"), model, opt, extra={"step": step})
    losses = train(model, opt, rank, world, STEPS - start, batch, first=start + 1, each=after)
    return dict(zip(range(start + 1, STEPS + 1), losses))


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_run_resumes_exactly(tmp_path, seed):
    kill_at = random.Random(seed).randint(EVERY + 1, STEPS)
    want = run_ranks(_train, 2, None, None, False)[0]
    with pytest.raises(RankFailure, match="rank 1 died|Another rank probably died"):
        run_ranks(_train, 2, str(tmp_path), kill_at, False, timeout=60)
    got = run_ranks(_train, 2, str(tmp_path), None, True)[0]
    assert got, "resume must run the remaining steps"
    assert all(got[s] == want[s] for s in got), {s: (got[s], want[s]) for s in got}
