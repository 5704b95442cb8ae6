"""Mixed precision against a one-process reference that applies the same casts (not looser tolerances)."""
import torch

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, same_casts_reference, train
from models import GPT, Block, gpt_batch

BF16 = fp.MixedPrecision(param_dtype=torch.bfloat16)


def _sharded(rank, world, steps):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, mixed_precision=BF16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fp.comm_stats.reset()
    dtypes = []
    losses = train(model, opt, rank, world, steps, each=lambda s, loss: dtypes.append(loss.dtype))
    assert set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master shards stay fp32"
    return losses, fp.full_state_dict(model), dict(fp.comm_stats.bytes)


def test_bf16_matches_reference_with_same_casts():
    want_losses, want_state = same_casts_reference(2, 4, torch.bfloat16)
    losses, state, _ = run_ranks(_sharded, 2, 4)[0]
    assert_close_losses(losses, want_losses)
    assert_close_state(state, want_state)


def test_bf16_halves_all_gather_bytes_and_reduces_in_fp32():
    _, _, mp_bytes = run_ranks(_sharded, 2, 1)[0]

    def fp32(rank, world):
        torch.manual_seed(0)
        model = fp.shard(GPT(), auto_wrap_policy={Block})
        fp.comm_stats.reset()
        model(*gpt_batch(0, rank)).backward()
        return dict(fp.comm_stats.bytes)
    full = run_ranks(fp32, 2)[0]
    assert mp_bytes["all_gather"] * 2 == full["all_gather"]
    assert mp_bytes["reduce_scatter"] == full["reduce_scatter"], "bf16 params reduce in fp32 by default"


def test_reduce_dtype_default():
    assert BF16.effective_reduce_dtype(torch.float32) == torch.float32
    assert fp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16).effective_reduce_dtype(
        torch.float32) == torch.bfloat16


def _scaler_worker(rank, world):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = fp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(*gpt_batch(0, rank))
    scaler.scale(loss).backward()
    if rank == 1:   # an overflow only this rank's shard can see
        next(p for p in model.parameters() if p.numel()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return unchanged, scaler.get_scale()


def test_grad_scaler_inf_check_agrees_across_ranks():
    for unchanged, scale in run_ranks(_scaler_worker, 2):
        assert unchanged, "every rank must skip the step"
        assert scale == 512.0
