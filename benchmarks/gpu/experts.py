"""Issue 55's device checks: expert parallel with transformers' experts kernels on CUDA (``torch._grouped_mm``
where the GPU has it), two ranks on one GPU (gloo, CUDA tensors).

    python benchmarks/gpu/experts.py [--dry]    # --dry: the same rows on CPU, tiny sizes

Rows (one ``GPU_CHECK_JSON {...}`` each):

1. ``ep_parity``: a tiny Qwen3-MoE in fp32 at ep 2 (each rank its own batch), 4 AdamW steps: every step's mean
   loss and the final parameters against one process on the global batch on the same GPU (<= 1e-5), with the
   experts implementation transformers ran.
2. ``ep_bytes``: bytes per step on the wire at ep 2 against no EP on the same two ranks (``fp.comm_stats``): the
   experts are never all-gathered under EP; tokens move by all-to-all instead.
3. ``ep_world1_bf16``: bf16 at world 1, sharded against unsharded: equal losses, peak memory of each.
4. ``ep_plan_world8``: ``fp.plan`` at fake world 8 (a 32-expert Qwen3-MoE, 4,096 tokens per rank, bf16):
   wire bytes and peak with ``expert_parallel=8`` against the experts gathered whole.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _one_gpu import device, emit, error_text, peak_mib, reset_peak, spawn  # noqa: E402

STEPS, VOCAB, SEQ, BATCH = 4, 96, 8, 2


def _qwen3_moe(dtype=torch.float32):
    import transformers as tf
    torch.manual_seed(1)          # tests/test_experts.py: a seed whose routing keeps a clear margin on this data
    cfg = tf.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8)
    return tf.Qwen3MoeForCausalLM(cfg).to(dtype).train()


def _adamw(params):
    return torch.optim.AdamW(params, lr=2e-3, eps=1e-6, weight_decay=0.1)      # tests/_parity.py's


def _batch(step, rank):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
    return ids


def _train(model, dev, batches):
    opt = _adamw(model.parameters())
    losses = []
    for ids in batches:
        ids = ids.to(dev)
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _parity_worker(rank, world, dev):
    import torch.distributed as dist

    import fsdp_plugin as fp
    model = fp.shard(_qwen3_moe().to(dev), expert_parallel=2, device=dev)
    losses = _train(model, dev, [_batch(s, rank) for s in range(STEPS)])
    for t in losses:
        dist.all_reduce(t)
    state = {k: v.float().flatten().tolist() for k, v in fp.full_state_dict(model).items()}
    return {"losses": [t.item() / world for t in losses], "state": state,
            "impl": getattr(model.config, "_experts_implementation", None)}


def _worker(rank, world, dev):
    """Both two-rank rows in one spawn (each spawn costs two CUDA and transformers start-ups)."""
    return {"parity": _parity_worker(rank, world, dev), "bytes": _bytes_worker(rank, world, dev)}


def parity_row(dry: bool, got: dict) -> dict:
    dev = device(dry)
    model = _qwen3_moe().to(dev)
    want = [t.item() for t in _train(model, dev, [torch.cat([_batch(s, r) for r in range(2)]) for s in range(STEPS)])]
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], want))
    param_diff = max((torch.tensor(got["state"][k]) - v.detach().float().cpu().flatten()).abs().max().item()
                     for k, v in model.state_dict().items() if k in got["state"])
    return {"check": "ep_parity", "ep": 2, "experts_implementation": got["impl"], "max_loss_diff": loss_diff,
            "max_param_diff": param_diff, "ok": loss_diff <= 1e-5 and param_diff <= 1e-5}


def _bytes_worker(rank, world, dev):
    import fsdp_plugin as fp
    out = {}
    for ep in (1, 2):
        model = fp.shard(_qwen3_moe().to(dev), expert_parallel=ep, device=dev)
        _train(model, dev, [_batch(0, rank)])          # the first step sets buffers up
        before = dict(fp.comm_stats.bytes)
        _train(model, dev, [_batch(1, rank)])
        out[ep] = {k: v - before.get(k, 0) for k, v in fp.comm_stats.bytes.items() if v - before.get(k, 0)}
        del model
    return out


def bytes_row(dry: bool, got: dict) -> dict:
    total = {ep: sum(v.values()) for ep, v in got.items()}
    return {"check": "ep_bytes", "per_kind_ep1": got["1"], "per_kind_ep2": got["2"], "total_ep1": total["1"],
            "total_ep2": total["2"], "ok": total["2"] < total["1"]}


def world1_row(dry: bool, got=None) -> dict:
    import tempfile

    import torch.distributed as dist

    import fsdp_plugin as fp
    dev = device(dry)
    batches = [_batch(s, 0) for s in range(STEPS)]
    reset_peak(dev)
    want = [t.item() for t in _train(_qwen3_moe(torch.bfloat16).to(dev), dev, batches)]
    plain_peak = peak_mib(dev)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        reset_peak(dev)
        model = fp.shard(_qwen3_moe(torch.bfloat16).to(dev), device=dev)
        got = [t.item() for t in _train(model, dev, batches)]
        impl = getattr(model.config, "_experts_implementation", None)
        fp.shutdown()
    return {"check": "ep_world1_bf16", "experts_implementation": impl, "losses": got, "unsharded": want,
            "peak_mib": peak_mib(dev), "unsharded_peak_mib": plain_peak, "ok": got == want}


def plan_row(dry: bool, got=None) -> dict:
    """fp.plan at fake world 8 on the device's throughputs: a Qwen3-MoE of 32 experts, expert_parallel=8 against
    the same job with the experts gathered (the planner runs the engine's own EP layout on fake tensors)."""
    import transformers as tf

    import fsdp_plugin as fp
    cfg = tf.Qwen3MoeConfig(vocab_size=32000, hidden_size=256 if dry else 1024, intermediate_size=1024,
                            num_hidden_layers=2 if dry else 8, num_attention_heads=8, num_key_value_heads=4,
                            moe_intermediate_size=256 if dry else 512, num_experts=32, num_experts_per_tok=4,
                            head_dim=32 if dry else 128)
    p = fp.plan(lambda: tf.Qwen3MoeForCausalLM(cfg), world_size=8, expert_parallel=8, mixed_precision="bf16",
                seq_len=512 if dry else 4096, batch_size=1, device="cpu" if dry else "cuda")
    w = p.worlds[8]
    ep = w.expert_parallel
    gib = 2**30
    return {"check": "ep_plan_world8", "wire_gib_with_ep": round(ep["wire_bytes_with_ep"] / gib, 3),
            "wire_gib_without_ep": round(ep["wire_bytes_without_ep"] / gib, 3),
            "all_to_all_gib": round(ep["all_to_all_bytes"] / gib, 3), "peak_gib": round(w.peak / gib, 3),
            "peak_gib_without_ep": round(ep["peak_without_ep"] / gib, 3), "recommend_ep": ep["recommend"],
            "recv_buffer_worst_mib": round(ep["recv_buffer_worst_bytes"] / 2**20, 1),
            "ok": ep["wire_bytes_with_ep"] < ep["wire_bytes_without_ep"]}


def main() -> int:
    dry = "--dry" in sys.argv
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (or --dry)")
        return 0
    try:
        got = spawn(_worker, 2, dry)
    except Exception as e:  # noqa: BLE001 - reported as a row; world 1 still runs
        got = {}
        emit({"check": "ep_ranks", "ok": False, "error": error_text(e)})
    ok = bool(got)
    for make in (parity_row, bytes_row, world1_row, plan_row):
        name = make.__name__.removesuffix("_row")
        try:
            row = make(dry, got.get(name))
        except Exception as e:  # noqa: BLE001 - the row reports it; the other rows still run
            row = {"check": f"ep_{name}", "ok": False, "error": error_text(e)}
        ok &= emit(row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
