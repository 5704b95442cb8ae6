"""hpZ: ``ShardingConfig(reshard_after_forward=<int r>)`` keeps a secondary shard over r consecutive ranks after
forward, so the backward all-gather stays inside the node; training is bit-identical to full_shard's."""
import pytest
import torch

import fsdp_plugin as fp
from tests._dist import RankFailure, run_ranks
from tests._parity import make_optimizer, train
from tests.models import GPT, Block, gpt_batch

TWO_NODES = {"LOCAL_WORLD_SIZE": "2"}


def _train(rank, world, rule, optim, strategy="full_shard", mesh=None, ac=None):
    torch.manual_seed(0)
    kwargs = {"device_mesh": mesh} if mesh else {}
    if ac:
        kwargs["activation_checkpointing"] = ac
    model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy=strategy, reshard_after_forward=rule, **kwargs)
    opt = make_optimizer(optim, model.parameters())
    held = []
    fp.comm_stats.reset()
    losses = train(model, opt, rank, world, 3)
    stats = fp.comm_stats.snapshot()
    model(*gpt_batch(9, rank))      # a forward with grad: what it keeps for backward
    for u in model._fp_root.units:
        held += [h.secondary.nbytes if h.secondary is not None else 0 for h in u.handles]
    non_root = [h.padded * h.compute_dtype.itemsize for u in model._fp_root.units[1:] for h in u.handles]
    return losses, fp.full_state_dict(model), stats, held, non_root


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_hpz_trains_bit_identically_to_full_shard_and_keeps_backward_gathers_in_the_node(optim):
    full = run_ranks(_train, 4, True, optim, env=TWO_NODES)
    hpz = run_ranks(_train, 4, 2, optim, env=TWO_NODES)
    for (fl, fs, fstats, fheld, _), (hl, hs, hstats, hheld, non_root) in zip(full, hpz):
        assert fl == hl
        for k in fs:
            assert torch.equal(fs[k], hs[k]), k
        assert fstats["calls"]["all_gather"] == hstats["calls"]["all_gather"]
        p = sum(non_root) // 4 * 3       # 3 steps
        # per non-root handle and step: forward over 4 ranks (2 of 3 peers off-node), backward over 2 (on-node)
        assert hstats["inter_node_bytes"]["all_gather"] == fstats["inter_node_bytes"]["all_gather"] - 2 * p
        assert hstats["intra_node_bytes"]["all_gather"] == fstats["intra_node_bytes"]["all_gather"] + p
        assert hstats["bytes"]["reduce_scatter"] == fstats["bytes"]["reduce_scatter"]
        assert sum(fheld) == 0 and sum(hheld) == sum(non_root) // 2     # +M/r per rank, r = 2
        assert hheld[0] == 0                                              # the root keeps its full parameters


def test_hpz_inside_hybrid_shard_groups():
    want = run_ranks(_train, 4, True, "adamw", "hybrid_shard", (1, 4), env=TWO_NODES)
    got = run_ranks(_train, 4, 2, "adamw", "hybrid_shard", (1, 4), env=TWO_NODES)
    for (wl, ws, *_), (gl, gs, *_) in zip(want, got):
        assert wl == gl and all(torch.equal(ws[k], gs[k]) for k in ws)


def test_hpz_with_activation_checkpointing_recomputes_from_the_secondary_gather():
    want = run_ranks(_train, 4, True, "sgd", "full_shard", None, True, env=TWO_NODES)
    got = run_ranks(_train, 4, 2, "sgd", "full_shard", None, True, env=TWO_NODES)
    for (wl, ws, wstats, *_), (gl, gs, gstats, *_) in zip(want, got):
        assert wl == gl and all(torch.equal(ws[k], gs[k]) for k in ws)
        assert gstats["inter_node_bytes"]["all_gather"] < wstats["inter_node_bytes"]["all_gather"]


def test_hpz_size_must_divide_the_shard_group():
    with pytest.raises(RankFailure, match="ConfigError: reshard_after_forward=3 does not divide the shard group of 4"):
        run_ranks(_train, 4, 3, "sgd")


def _report_and_checkpoint(rank, world, rule, path):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, reshard_after_forward=rule)
    opt = torch.optim.AdamW(model.parameters())
    model(*gpt_batch(0, rank)).backward()
    opt.step()
    fp.save_checkpoint(f"{path}/{rule}", model, opt)
    return fp.memory_report(model)


def test_memory_report_names_hpz_and_checkpoints_never_hold_the_secondary_shard(tmp_path):
    import os
    reports = run_ranks(_report_and_checkpoint, 4, 2, str(tmp_path), env=TWO_NODES)
    run_ranks(_report_and_checkpoint, 4, True, str(tmp_path), env=TWO_NODES)
    assert "hpZ: secondary shards over groups of 2 ranks" in reports[0]
    files = {r: sorted((f, os.path.getsize(tmp_path / str(r) / f)) for f in os.listdir(tmp_path / str(r)))
             for r in (2, True)}
    assert [f for f, _ in files[2]] == [f for f, _ in files[True]]
    assert [n for f, n in files[2] if f.endswith(".safetensors")] == \
        [n for f, n in files[True] if f.endswith(".safetensors")]
