"""Bytes per step and step time of a small Qwen3-MoE with and without expert parallelism, and under torch
FSDP2 (CPU, gloo, fp32).

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/experts_bytes.py --ep 1
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/experts_bytes.py --ep 2
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/experts_bytes.py --fsdp2

``--ep 1`` is plain full_shard (every expert all-gathered in forward and backward, its gradient
reduce-scattered); ``--ep 2`` is ``expert_parallel=2`` (experts stay on their EP rank: tokens travel by
all-to-all); ``--fsdp2``: torch's ``fully_shard`` on every decoder layer and the root (it has no expert
parallelism), its all-gathers and reduce-scatters counted with the same ring formula as ``fp.comm_stats``.
Same model (seed 0), same per-rank batches, AdamW. Rank 0 prints one ``BENCH_JSON {...}`` line: this rank's
bytes per step by kind, median step seconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
import transformers as tf

import fsdp_plugin as fp


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--fsdp2", action="store_true", help="torch FSDP2 instead of fsdp_plugin")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                            moe_intermediate_size=a.moe_intermediate, num_hidden_layers=a.layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=a.hidden // 4,
                            num_experts=a.experts, num_experts_per_tok=2)
    model = tf.Qwen3MoeForCausalLM(cfg)
    counted = _fsdp2(model) if a.fsdp2 else fp.comm_stats.bytes
    if not a.fsdp2:
        fp.shard(model, expert_parallel=a.ep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 1024, (a.batch, a.seq), generator=g)
    times = []
    for step in range(2 + a.steps):
        if step == 2:
            counted.clear()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    per_step = {k: v // a.steps for k, v in counted.items()}
    if rank == 0:
        print("BENCH_JSON " + json.dumps({"backend": "fsdp2" if a.fsdp2 else "fsdp_plugin", "ep": a.ep,
                                          "world": world, "experts": a.experts, "hidden": a.hidden,
                                          "tokens_per_rank": a.batch * a.seq, "bytes_per_step": per_step,
                                          "step_s": round(statistics.median(times[2:]), 4)}))
    dist.destroy_process_group()


def _fsdp2(model) -> Counter:
    """torch FSDP2 on every decoder layer and the root; a Counter of its collective bytes (ring formula)."""
    from torch.distributed.fsdp import fully_shard

    counted: Counter = Counter()
    n = dist.get_world_size()
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(out, inp, *args, **kwargs):
        counted["all_gather"] += out.numel() * out.element_size() * (n - 1) // n
        return gather(out, inp, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        counted["reduce_scatter"] += input.numel() * input.element_size() * (n - 1) // n
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return counted


if __name__ == "__main__":
    main()
