"""Context parallel composed with tensor parallel (issue 54 item 4/5: "cp 2 x tp 2"), on gloo.

The recipe: one root mesh (dp, cp, tp) = (1, 2, 2), transformers' Llama parallelized on mesh['tp'] with its own
tp_plan (GQA 4/2 heads: 2 query and 1 K/V head per TP rank), fp.shard(device_mesh=mesh['dp', 'cp'],
context_parallel=2). Every rank passes the same full batch (odd length 11: padded to 12 and split 6/6); per
step of 4 AdamW steps the loss, every full gradient and every full parameter are within 1e-5 of one process;
Ulysses too, on 8/4 heads (it splits each TP rank's heads over CP). The CP bytes per step show the local heads.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import _tp
from _dist import run_ranks

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

STEPS, SEQ = 4, 11


def _batch(step: int, group: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * step + 5 + 1000 * group)
    return torch.randint(0, 64, (2, SEQ), generator=g)


def _llama(heads: int = 4):
    """_tp's tiny Llama (4 query / 2 K/V heads), or with ``heads`` query heads (half as many K/V heads)."""
    if heads == 4:
        return _tp.llama()
    from transformers import LlamaForCausalLM
    cfg = _tp.llama_config()
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = heads, heads // 2, 4
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _reference(steps: int = STEPS, seq: int = SEQ, dp: int = 1, optim: str = "adamw", heads: int = 4) -> list:
    """One process on the global batch (the ``dp`` data-parallel groups' batches concatenated)."""
    model = _llama(heads)
    opt = _tp.make_optimizer(optim, model.parameters())
    out = []
    for s in range(steps):
        idx = torch.cat([_batch(s, g) for g in range(dp)])[:, :seq]
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append((loss.item(), grads, {n: p.detach().clone() for n, p in model.state_dict().items()}, None))
    return out


def _sharded(method: str = "allgather", dims=("dp", "cp"), heads: int = 4):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    model = parallelize_hf(_llama(heads), mesh["tp"])
    fp.shard(model, device_mesh=mesh[dims], context_parallel=2, auto_wrap_policy={LlamaDecoderLayer},
             context_parallel_attention=method)
    return model


def _worker(rank, world, method, heads):
    model = _sharded(method, heads=heads)
    assert (fp.data_parallel_size(model), fp.data_parallel_rank(model)) == (1, 0)
    root = model._fp_root
    # parameters shard over dp x cp (2 ranks of one TP coordinate); CP pairs are {r, r + 2} (tp innermost)
    assert root.mesh.shard_size == 2 and sorted(dist.get_process_group_ranks(root.mesh.cp_group)) == [rank % 2,
                                                                                                   rank % 2 + 2]
    opt = _tp.make_optimizer("adamw", model.parameters())
    out = []
    for s in range(STEPS):
        idx = _batch(s)
        kinds = ("cp_kv", "cp_ulysses") if method != "ring" else ("cp_kv_ring", "cp_ulysses")
        kv, a2a = (fp.comm_stats.bytes[k] for k in kinds)
        res = model(input_ids=idx, labels=idx)
        assert res.logits.shape[1] == 6, "the model did not run on a split sequence"
        kv, a2a = fp.comm_stats.bytes[kinds[0]] - kv, fp.comm_stats.bytes[kinds[1]] - a2a
        if method != "ulysses":     # this TP rank's ONE K/V head (k and v, 2 layers): (B 2, 1 head, 6, D 4) fp32
            assert (kv, a2a) == (2 * 2 * (2 * 1 * 6 * 4 * 4), 0), (kv, a2a)
        else:                       # q (4 local heads), k, v (2) out and the output back: 12 heads' worth, half sent
            assert (kv, a2a) == (0, 2 * (2 * 12 * 6 * 4 * 4) // 2), (kv, a2a)
        opt.zero_grad()
        res.loss.backward()
        grads = _tp.full_grads(model)
        opt.step()
        out.append((res.loss.item(), grads, fp.full_state_dict(model, rank0_only=False), None))
    return out


@pytest.mark.parametrize("method,heads", [("allgather", 4), ("ring", 4), ("ulysses", 8)])
def test_cp2_tp2_llama_matches_one_process(method, heads):
    """All-gather K/V with 2/1 local heads per TP rank (the ring: the same block rotated, CP pairs {r, r + 2});
    Ulysses with 8/4 heads (4/2 per TP rank, 2/1 per CP rank)."""
    want = _reference(heads=heads)
    results = run_ranks(_worker, 4, method, heads, timeout=300)
    for got in results:
        _tp.assert_matches(got, want)
    with pytest.raises(AssertionError):     # the comparison can fail: another sequence length's trajectory
        _tp.assert_matches(results[0], _reference(seq=SEQ - 1, heads=heads))


def _refusals_worker(rank, world):
    from fsdp_plugin.errors import ConfigError, UnsupportedError
    with pytest.raises(ConfigError, match="last dimension is the CP dimension"):
        _sharded(dims="cp")        # a 1-D mesh: which dimension is data parallel is not said
    model = _sharded("ulysses")
    idx = _batch(0)
    # Ulysses splits THIS TP rank's heads (2 query, 1 K/V) over cp 2: refused by name, the mode that can named
    with pytest.raises(UnsupportedError, match="2 query and 1 key/value heads.*'allgather'"):
        model(input_ids=idx, labels=idx)
    return True


def test_refusals_name_the_recipe_and_local_heads():
    assert run_ranks(_refusals_worker, 4, timeout=300) == [True] * 4


MESHES = [("full_shard", (2, 2), ("dp", "cp")), ("hybrid_shard", (2, 1, 2), ("dp_replicate", "dp_shard", "cp"))]


def _mesh_worker(rank, world, strategy, shape, names):
    """No TP: the same recipe on a (dp, cp) / (replicate, shard, cp) mesh that is the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = fp.shard(_tp.llama(), device_mesh=mesh, context_parallel=2, sharding_strategy=strategy,
                     auto_wrap_policy={LlamaDecoderLayer})
    group = fp.data_parallel_rank(model)
    assert (fp.data_parallel_size(model), group) == (2, rank // 2)
    opt = _tp.make_optimizer("sgd", model.parameters())
    out = []
    for s in range(2):
        idx = _batch(s, group)
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = _tp.full_grads(model)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append((t.item() / world, grads, fp.full_state_dict(model, rank0_only=False), None))
    return out


@pytest.mark.parametrize("strategy,shape,names", MESHES, ids=[m[0] for m in MESHES])
def test_dp2_cp2_on_a_device_mesh(strategy, shape, names):
    """dp 2 x cp 2 from a DeviceMesh: the data-parallel view (rank, size) and the gradient divisor (sum over
    cp, mean over dp; SGD sees a wrong scale) match one process on the two groups' batches, 2 steps."""
    want = _reference(2, dp=2, optim="sgd")
    for got in run_ranks(_mesh_worker, 4, strategy, shape, names, timeout=300):
        _tp.assert_matches(got, want)


def _save_worker(rank, world, path):
    model = _sharded()
    opt = _tp.make_optimizer("adamw", model.parameters())
    for s in range(2):
        idx = _batch(s)
        opt.zero_grad()
        model(input_ids=idx, labels=idx).loss.backward()
        opt.step()
    fp.save_checkpoint(path, model, opt)
    return True


def _resume_worker(rank, world, path):
    """Without CP: dp 1 x tp 2, the same Llama and tp_plan; loads the cp 2 x tp 2 checkpoint, trains step 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_hf(_llama(), mesh["tp"])
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={LlamaDecoderLayer})
    opt = _tp.make_optimizer("adamw", model.parameters())
    fp.load_checkpoint(path, model, opt)
    idx = _batch(2)
    loss = model(input_ids=idx, labels=idx).loss
    opt.zero_grad()
    loss.backward()
    grads = _tp.full_grads(model)
    opt.step()
    return [(loss.item(), grads, fp.full_state_dict(model, rank0_only=False), None)]


def test_checkpoint_saved_at_cp2_tp2_resumes_at_tp2_without_cp(tmp_path):
    """Saved after 2 steps at cp 2 x tp 2 (world 4), resumed at tp 2 without CP (world 2): its step 2 (loss,
    gradients, weights) is the one-process trajectory's, so weights and AdamW state came back whole."""
    want = _reference(3)
    path = str(tmp_path / "ck")
    assert run_ranks(_save_worker, 4, path, timeout=300) == [True] * 4
    for got in run_ranks(_resume_worker, 2, path, timeout=300):
        _tp.assert_matches(got, want[2:])
