"""Bad input ends in a specific exception whose message names the fix."""

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from models import GPT, Block, gpt_batch


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(fp.ConfigError, match="full_shard, shard_grad_op, no_shard, hybrid_shard"):
        fp.ShardingConfig(sharding_strategy="zero3")


def test_unknown_option_is_named():
    with pytest.raises(fp.ConfigError, match="reshard_after_forwards"):
        fp.shard(GPT(), reshard_after_forwards=True)


def test_wrap_policy_matching_nothing_lists_classes():
    class Missing(nn.Module):
        pass
    with pytest.raises(fp.ConfigError, match="matches no submodule.*Block"):
        fp.shard(GPT(), auto_wrap_policy={Missing})


def test_mixed_precision_must_be_the_dataclass():
    with pytest.raises(fp.ConfigError, match="MixedPrecision"):
        fp.ShardingConfig(mixed_precision="bf16")


def _bad_mesh(rank, world):
    fp.shard(GPT(), sharding_strategy="hybrid_shard", device_mesh=(3, 1))


def test_mesh_not_dividing_world():
    with pytest.raises(AssertionError, match=r"needs 3 ranks but the world has 2.*R\*S == 2"):
        run_ranks(_bad_mesh, 2)


def test_shard_twice():
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    with pytest.raises(fp.ShardingError, match="already sharded"):
        fp.shard(model)


def _stepped_before_shard(rank, world):
    model = GPT()
    opt = torch.optim.Adam(model.parameters())
    model(*gpt_batch(0, 0)).backward()
    opt.step()
    fp.shard(model, auto_wrap_policy={Block})
    model(*gpt_batch(1, 0)).backward()
    try:
        opt.step()
    except fp.OptimizerError as e:
        return str(e)


def test_optimizer_that_stepped_before_shard():
    """On 2 ranks the old full-shape state fits no piece; on 1 rank pieces are whole, so it still fits."""
    assert all("before fp.shard" in (m or "") for m in run_ranks(_stepped_before_shard, 2))


def test_optimizer_built_before_shard_without_state_just_works():
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # same Parameter objects survive shard()
    fp.shard(model, auto_wrap_policy={Block})
    model(*gpt_batch(0, 0)).backward()
    opt.step()
    assert all(hasattr(p, "_fp_handle") for p in model.parameters())


def test_dtype_backend_cannot_reduce():
    model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(fp.ConfigError, match="cannot reduce.*reduce_dtype=torch.float32"):
        fp.shard(model)


def test_per_tensor_optimizer_on_one_rank_is_exact_and_silent():
    """One rank: every piece is the whole tensor, so Adafactor runs as unsharded (2+ ranks, the owner step: tests/test_owner_step.py)."""
    import warnings

    torch.manual_seed(0)
    plain = GPT()
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    opts = [torch.optim.Adafactor(m.parameters()) for m in (plain, model)]
    for m, opt in zip((plain, model), opts):
        m(*gpt_batch(0, 0)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
    want, got = plain.state_dict(), fp.full_state_dict(model)
    assert all((want[k] - got[k]).abs().max() <= 1e-6 for k in want)


def test_plain_state_dict_refused_outside_full_params():
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    with pytest.raises(fp.StateDictError, match="fp.full_state_dict.*fp.save_checkpoint.*fp.full_params"):
        model.state_dict()
    with pytest.raises(fp.StateDictError):
        model.load_state_dict({})


def test_full_params_state_dict_and_load_write_back():
    torch.manual_seed(0)
    plain = GPT()
    torch.manual_seed(1)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    with fp.full_params(model):
        assert model.state_dict().keys() == plain.state_dict().keys()
        model.load_state_dict(plain.state_dict())
    got = fp.full_state_dict(model)
    for k, v in plain.state_dict().items():
        assert torch.equal(got[k], v), k


def test_not_sharded_is_explained():
    assert not fp.is_sharded(GPT())
    with pytest.raises(fp.ShardingError, match="call fp.shard"):
        with fp.no_sync(GPT()):
            pass
