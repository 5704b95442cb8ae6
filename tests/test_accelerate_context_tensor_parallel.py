"""accelerate ``ParallelismConfig(cp_size=2, tp_size=2)`` on the engine (issue 54: cp x tp through the plug-in), 4
forked gloo ranks, no launcher. The plug-in applies the model's tp_plan on "tp" and shards over a (dp_shard, cp)
mesh of accelerate's layout (CP pairs {r, r + 2}); stock accelerate keeps its mesh and gives every rank the same
batches (one dp rank). Per step of 4 AdamW steps the loss and every full parameter are within 1e-5 of one process
on the same batches, for torch's "allgather" and its rotating "alltoall" (our ring), from a ParallelismConfig in
code and from the launcher's PARALLELISM_CONFIG_* env."""
from __future__ import annotations

import os

import pytest
import torch

import _tp
from _dist import run_ranks

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

STEPS, BATCH, SEQ = 4, 2, 11       # odd length: padded to 12 and split 6/6
ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
       "FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
       "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "localhost", "MASTER_PORT": "0"}
ISSUED = {"allgather": "cp_kv", "alltoall": "cp_kv_ring"}


def _samples():
    return torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _reference(seq: int = SEQ):
    model = _tp.llama()
    opt = _tp.make_optimizer("adamw", model.parameters())
    out = []
    for ids in _samples()[:, :seq].split(BATCH):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((loss.item(), {n: p.detach().clone() for n, p in model.state_dict().items()}))
    return out


def _worker(rank, world, strategy, from_env):
    os.environ.update(ENV)
    import accelerate
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchContextParallelConfig

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    import fsdp_plugin as fp
    from fsdp_plugin.integrations.accelerate import Accelerator

    if from_env:    # what `accelerate launch` exports for a yaml `parallelism_config:` block
        os.environ.update({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
                           "PARALLELISM_CONFIG_CP_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2",
                           "PARALLELISM_CONFIG_CP_COMM_STRATEGY": strategy})
        acc = Accelerator()
    else:
        acc = Accelerator(parallelism_config=accelerate.ParallelismConfig(
            dp_shard_size=1, cp_size=2, tp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy)))
    model = _tp.llama()
    opt = _tp.make_optimizer("adamw", model.parameters())
    loader = torch.utils.data.DataLoader(_samples(), batch_size=BATCH)
    model, opt, loader = acc.prepare(model, opt, loader)
    root = model._fp_root
    assert (fp.data_parallel_size(model), fp.data_parallel_rank(model)) == (1, 0)
    assert sorted(dist.get_process_group_ranks(root.mesh.cp_group)) == [rank % 2, rank % 2 + 2]
    with fp.full_params(model):     # the TP boxes rebuilt with their specs: the tp_plan was applied on "tp"
        assert sum(type(p).__name__ == "DTensor" for p in model.parameters()) > 0, "no tensor parallelism"
    out, seen = [], []
    for ids in loader:
        seen.append(ids.tolist())
        with acc.maybe_context_parallel():
            res = model(input_ids=ids, labels=ids)
        assert res.logits.shape[1] == 6, "the model did not run on a split sequence"
        acc.backward(res.loss)
        opt.step()
        opt.zero_grad()
        out.append((res.loss.item(), fp.full_state_dict(model, rank0_only=False)))
    calls = {k: fp.comm_stats.calls[k] for k in ("cp_kv", "cp_kv_ring", "cp_ulysses")}
    return seen, out, calls


def _check(got, want):
    assert len(got) == len(want) == STEPS
    for s, ((loss, params), (w_loss, w_params)) in enumerate(zip(got, want)):
        assert abs(loss - w_loss) <= 1e-5, f"step {s}: loss {loss} vs {w_loss}"
        assert params.keys() == w_params.keys()
        for k, v in w_params.items():
            d = (params[k] - v).abs().max().item()
            assert d <= 1e-5, f"step {s}: {k} off by {d:.3e}"


CASES = [("allgather", False), ("alltoall", False), ("alltoall", True)]


@pytest.mark.parametrize("strategy,from_env", CASES, ids=["allgather", "alltoall", "alltoall-launcher-env"])
def test_parallelism_config_cp2_tp2_matches_one_process(strategy, from_env):
    want = _reference()
    results = run_ranks(_worker, 4, strategy, from_env, timeout=300)
    batches = _samples().view(STEPS, BATCH, SEQ).tolist()
    for seen, out, calls in results:
        assert seen == batches, "every rank (one dp rank) must read the same batches"
        assert [k for k, n in calls.items() if n] == [ISSUED[strategy]], calls
        _check(out, want)
    with pytest.raises(AssertionError):     # the comparison can fail: another sequence length's trajectory
        _check(results[0][1], _reference(SEQ - 1))
