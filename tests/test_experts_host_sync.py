"""Expert parallelism on NCCL's branch (``nccl_sim``, ``fsdp_plugin.testing``), counted (issue 55).

Each experts call needs its split sizes on the host: one all-to-all of the routes per expert, which the host
waits for and reads. Nothing else of it blocks the host: the local expert ids follow from those counts (no ids
exchange), and the rows' all-to-alls (dispatch, combine, and both in backward) are waited by the stream only.
So a forward blocks the host once per MoE layer and a backward never (was 4 and 2 per layer). The numbers are
the gloo run's, the waits being only reordered.
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp

SIM = {"FSDP_TEST_BACKEND": "nccl_sim"}
LAYERS = 2


def _counted(rank, world, kind):
    import test_experts as t
    import test_experts_per_expert as tp
    model = t._build("qwen3_moe") if kind == "fused" else tp._build()
    fp.shard(model, expert_parallel=2, timeout_s=60)
    model(**t._batch(0, rank)).loss.backward()       # warm-up step: the engine's one-time waits
    fp.sync_stats.reset()
    loss = model(**t._batch(1, rank)).loss
    forward = sum(fp.sync_stats.host.values())
    fp.sync_stats.reset()
    loss.backward()
    backward = sum(fp.sync_stats.host.values())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return forward, backward, loss.item(), grads


@pytest.mark.parametrize("kind", ["fused", "per_expert"])
def test_one_host_wait_per_moe_layer_forward_none_in_backward(kind):
    sim = run_ranks(_counted, 2, kind, env=SIM, timeout=120)
    gloo = run_ranks(_counted, 2, kind, timeout=120)
    for (fwd, bwd, loss, grads), (_, _, gloo_loss, gloo_grads) in zip(sim, gloo):
        assert (fwd, bwd) == (LAYERS, 0), (kind, fwd, bwd)
        assert loss == gloo_loss
        assert grads.keys() == gloo_grads.keys()
        assert all(torch.allclose(grads[n], gloo_grads[n], rtol=0, atol=1e-6) for n in grads)
