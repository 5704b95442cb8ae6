"""No silent hangs: failures and divergence become errors naming the rank, unit and collective."""
import time

import torch

import fsdp_plugin as fp
from _dist import run_ranks
from models import GPT, Block, gpt_batch


def _one_rank_stalls(rank, world):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, timeout_s=2)
    if rank == 1:
        time.sleep(8)          # alive but never joins the collective (e.g. stuck in data loading)
        return None
    start = time.monotonic()
    try:
        model(*gpt_batch(0, rank)).backward()
    except fp.CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_stalled_rank_becomes_a_collective_error_in_bounded_time():
    message, waited = run_ranks(_one_rank_stalls, 2, timeout=60)[0]
    assert "rank 0" in message and "unit" in message and "timeout_s" in message, message
    assert waited < 6, waited


class Branchy(GPT):
    def forward(self, idx, targets=None):
        import torch.distributed as dist
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        blocks = self.blocks if dist.get_rank() == 0 else reversed(self.blocks)   # a rank-dependent order
        for blk in blocks:
            x = blk(x)
        return self.head(self.ln_f(x)).sum()


def _diverged(rank, world):
    torch.manual_seed(0)
    model = fp.shard(Branchy(), auto_wrap_policy={Block}, timeout_s=10)
    try:
        model(gpt_batch(0, rank)[0])
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_divergent_unit_order_is_caught_on_the_first_step():
    for message in run_ranks(_diverged, 2, timeout=60):
        assert "ranks diverged" in message and "'blocks.0'" in message and "'blocks.2'" in message, message


class FailsOnce(GPT):
    fail = True

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        if FailsOnce.fail:
            FailsOnce.fail = False
            raise RuntimeError("bad batch")
        return out


def test_a_forward_that_raises_leaves_the_model_usable():
    torch.manual_seed(0)
    model = fp.shard(FailsOnce(), auto_wrap_policy={Block})
    x, y = gpt_batch(0, 0)
    try:
        model(x, y)
    except RuntimeError:
        pass
    assert all(hasattr(p, "_fp_handle") for p in model.parameters()), "the root is resharded after the exception"
    model(x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
