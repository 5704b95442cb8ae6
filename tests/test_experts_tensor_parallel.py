"""Expert parallel composed with tensor parallel (issue 55: "exact ... with tensor parallel"), on gloo.

The recipe: one root mesh (dp, tp) = (2, 2); transformers' MoE parallelized on mesh['tp'] with its own tp_plan
minus the experts' entries (attention colwise/rowwise, Qwen3's per-head q_norm/k_norm replicated with their
gradient summed over TP); fp.shard(device_mesh=mesh['dp'], expert_parallel=2). The experts stay whole on every
TP rank and are split over the data-parallel ranks: the EP group of a rank is the dp ranks at its TP coordinate
({0, 2} and {1, 3}), whose all-to-alls carry the tokens both TP ranks of a TP group share. Every step of 4 AdamW
steps: the loss, the ``fp.clip_grad_norm_`` norm and every parameter within 1e-5 of one process on the global
batch (test_experts' reference and check).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from test_experts import STEPS, _build, _check, _optimizer, _phase, _reference, _train

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks


def _plan(model) -> dict:
    """The model's tp_plan without the experts' entries, and without keys the tiny model has no module for
    (Qwen3-MoE's dense-MLP keys: every layer here is sparse)."""
    import re
    names = [n for n, _ in model.named_modules()]
    keep = {}
    for key, style in model.tp_plan.items():
        rx = re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")
        if ".experts" not in key and any(rx.match(n) for n in names):
            keep[key] = style
    return keep


def _sharded(name, aux=False, experts=(), hybrid=False, ep=2, impl=None):
    """``experts``: the tp_plan's experts entries to keep (a refusal case); ``hybrid``: a (2, 2, 2)
    (dp_replicate, dp_shard, tp) mesh under hybrid_shard (world 8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    if hybrid:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp, extra = mesh["dp_replicate", "dp_shard"], {"sharding_strategy": "hybrid_shard"}
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, extra = mesh["dp"], {}
    model = _build(name, aux=aux, impl=impl)
    plan = {**_plan(model), **{k: v for k, v in model.tp_plan.items() if k.endswith(experts)}} if experts \
        else _plan(model)
    model = parallelize_hf(model, mesh["tp"], plan)
    return fp.shard(model, device_mesh=dp, expert_parallel=ep, timeout_s=60, **extra)


def _worker(rank, world, name, aux=False, save=None, hybrid=False, ep=2, impl=None):
    model = _sharded(name, aux, hybrid=hybrid, ep=ep, impl=impl)
    emesh = model._fp_root.experts_mesh
    if ep > 1:
        first = rank - rank // 2 % 2 * 2      # the EP group: the 2 dp_shard ranks at this replica and TP coordinate
        assert sorted(dist.get_process_group_ranks(emesh.ep_group)) == [first, first + 2]
        assert emesh.shard_size == 1
    assert (fp.data_parallel_size(model), fp.data_parallel_rank(model)) == (world // 2, rank // 2)
    fp.comm_stats.reset()
    opt = _optimizer(model.parameters())
    steps = _train(model, opt, rank // 2, world, 2 if save else STEPS)
    if save is not None:
        fp.save_checkpoint(save, model, opt)
    return {"steps": steps, "a2a": fp.comm_stats.bytes.get("all_to_all", 0)}


def test_qwen3_tp2_without_expert_parallel():
    """The same recipe without EP (experts whole on every TP rank, dp-sharded): Qwen3's q_norm/k_norm
    (transformers' replicated_with_grad_allreduce, which failed under fp.shard before) train exactly."""
    want = _reference("qwen3_moe", 2)
    _check(run_ranks(_worker, 4, "qwen3_moe", False, None, False, 1, timeout=240), want)


MODELS = [("qwen3_moe", False, False, None), ("mixtral", False, False, None), ("qwen3_moe", True, False, None),
          ("qwen3_moe", False, True, None), ("deepseek_v3", False, False, None), ("gpt_oss", False, False, "eager")]


@pytest.mark.parametrize("name,aux,hybrid,impl", MODELS,
                         ids=["qwen3_moe", "mixtral", "qwen3_moe-aux_loss", "qwen3_moe-hybrid", "deepseek_v3",
                              "gpt_oss"])
def test_ep2_tp2_matches_one_process(name, aux, hybrid, impl):
    """dp 2 x tp 2, EP 2 over dp: the one-process numbers at every step (aux: the router's auxiliary loss on the
    global batch; its router logits are gathered over the world, each dp rank's tp times, which changes no mean;
    hybrid: 2 replicas x dp_shard 2 x tp 2, world 8, the experts replicated across the replicas)."""
    world = 8 if hybrid else 4
    want = _reference(name, world // 2, aux=aux, impl=impl)
    results = run_ranks(_worker, world, name, aux, None, hybrid, 2, impl, timeout=240)
    _check(results, want)
    assert all(r["a2a"] > 0 for r in results)


def _bias_worker(rank, world, per_world=False):
    """DeepSeek-V3 at dp 2 x tp 2, EP 2, fp.update_router_bias after every step (``per_world``: the broken
    variant, loads summed over the world: each route counted once per TP rank)."""
    from test_experts_router_bias import _after
    from fsdp_plugin._experts import router_bias
    model = _sharded("deepseek_v3")
    if per_world:
        real = router_bias.comm.all_reduce
        shard_group = model._fp_root.mesh.shard_group
        router_bias.comm.all_reduce = lambda t, group, **k: real(t, None, **k) if group is shard_group else None
    biases = []
    steps = _train(model, _optimizer(model.parameters()), rank // 2, world, STEPS,
                   after=lambda step, m: biases.append(_after(m)))
    return {"steps": steps, "biases": biases}


def test_router_bias_under_ep2_tp2():
    """DeepSeek-V3's bias update under EP x TP: the loads of the global batch (the dp ranks' routes, each once:
    a TP group's ranks route the same tokens), every bias within 1e-6 of one process's at every step and the
    training numbers within 1e-5. Summing over the world instead counts every route twice (tp 2): refused by the
    loads check."""
    from test_experts_router_bias import _check_biases, _reference as bias_reference
    want = bias_reference(2)
    results = run_ranks(_bias_worker, 4, timeout=240)
    _check_biases(results[::2], want)     # loads = dp (2) x BATCH x SEQ x top 2 routes
    _check_biases(results[1::2], want)
    _check(results, [w[:3] for w in want])
    broken = run_ranks(_bias_worker, 4, True, timeout=240)
    with pytest.raises(AssertionError):
        _check_biases(broken[::2], want)


def test_the_check_can_fail(monkeypatch):
    """Two broken variants fail it: expert gradients divided by the expert-shard count (1 here: 2x too large),
    and Qwen3's q_norm/k_norm gradients not summed over TP (each TP rank's covers its own heads only)."""
    from fsdp_plugin._experts.spec import ExpertMesh
    from fsdp_plugin._flat import dtensor, flat_param
    want = _reference("qwen3_moe", 2)
    with monkeypatch.context() as m:
        m.setattr(ExpertMesh, "reduce_world", property(lambda self: self.shard_size * self.replicate_size))
        results = run_ranks(_worker, 4, "qwen3_moe", timeout=240)
        with pytest.raises(AssertionError, match="grad norm"):
            _check(results, want)
    with monkeypatch.context() as m:
        m.setattr(flat_param, "as_parallel", lambda v, t: v if t.grad_sum else dtensor.as_dtensor(v, t))
        results = run_ranks(_worker, 4, "qwen3_moe", timeout=240)
        with pytest.raises(AssertionError):
            _check(results, want)


def test_checkpoint_saved_at_ep2_tp2_resumes_at_ep2_without_tp(tmp_path):
    """Saved after 2 steps at EP 2 x TP 2 (world 4: experts written once, from TP coordinate 0), resumed at EP 2
    without TP (world 2, the same dp batches): steps 2-3 are the uninterrupted one-process run's."""
    path = str(tmp_path / "ck")
    want = _reference("qwen3_moe", 2)
    got_a = run_ranks(_worker, 4, "qwen3_moe", False, path, timeout=240)
    got_b = run_ranks(_phase, 2, 2, None, path, None, 2, 2, timeout=240)
    _check([{"steps": got_a[r]["steps"] + got_b[r]} for r in range(2)], want)


def _refused(rank, world):
    from fsdp_plugin.errors import ConfigError, TensorParallelError
    with pytest.raises(TensorParallelError, match="packed_colwise"):
        _sharded("mixtral", experts=(".experts", ".gate_up_proj", ".down_proj"))     # the model's whole plan
    with pytest.raises(ConfigError, match=r"mlp.experts.down_proj is in the TP plan.*stay whole on every TP rank"):
        _sharded("mixtral", experts=(".down_proj",))                                  # rowwise: a Shard DTensor
    with pytest.raises(ConfigError, match=r"mlp.experts.forward is in the TP plan"):
        _sharded("mixtral", experts=(".experts",))      # moe_tp_experts alone: an all-reduce of whole experts' sums
    import torch.distributed as dist
    dist.barrier()      # no rank exits while a peer still connects the groups the refused calls created (gloo)
    return True


def test_experts_in_the_tp_plan_are_refused():
    """The experts stay whole on every TP rank under EP x TP: the model's full tp_plan (packed_colwise), a
    rowwise down_proj and moe_tp_experts alone are each refused by name at fp.shard, not trained wrongly."""
    assert run_ranks(_refused, 4, timeout=240) == [True] * 4
