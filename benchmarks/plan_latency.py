"""Issue 30: the per-step latency terms of fp.plan at cluster scale, for the Llama-3 8B and 70B shapes.

    python benchmarks/plan_latency.py [--latency-us 30] [--worlds 64 512 1024]

Every row comes from ``fp.plan(..., link_latency_us=...)`` (``WorldPlan.latency``, ``planner/_latency.py``):
bytes per rank per step, unit and control collectives per step, host-blocking waits per step, the ring
latency floor (collectives × ring steps × latency) and the status thread's store traffic. bf16 compute,
AdamW, one sequence of 4,096 tokens per rank, 8 GPUs per node (hybrid shards inside a node), CUDA target.
Prints the Markdown table of docs/INTERNALS.md.
"""
from __future__ import annotations

import argparse

import fsdp_plugin as fp

SHAPES = {   # Llama-3 (Meta's published configurations)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
}


def _model(shape: dict):
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def rows(worlds, latency_us: float, strategies, checks, seq: int):
    import dataclasses

    from fsdp_plugin.planner.api import plan_configs, split_options
    for name, shape in SHAPES.items():
        model = _model(shape)
        base, run = split_options(None, dict(mixed_precision="bf16", device="cuda", seq_len=seq, batch_size=1,
                                             link_latency_us=latency_us))
        combos = [(s, c) for s in strategies for c in checks]
        cfgs = [dataclasses.replace(base, sharding_strategy=s, pairing_check=c) for s, c in combos]
        for (strategy, check), plan in zip(combos, plan_configs(model, worlds, cfgs, **run)):   # one fake run
            for w in worlds:
                wp = plan.worlds[w]
                yield name, strategy, check, w, wp.wire_total, wp.latency


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-us", type=float, default=30.0)
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--strategies", nargs="+", default=["full_shard", "hybrid_shard"])
    ap.add_argument("--checks", nargs="+", default=["auto", "strict"])
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args()
    print(f"| model | strategy | pairing_check | ranks | bytes/rank/step | unit coll./step | control coll./step "
          f"| blocking waits/step | latency floor ({a.latency_us:.0f} µs/hop) | store ops/s (all ranks) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, strategy, check, w, wire, lat in rows(a.worlds, a.latency_us, a.strategies, a.checks, a.seq):
        print(f"| {name} | {strategy} | {check} | {w} | {wire / 2**30:.1f} GiB | {lat['unit_collectives']} "
              f"| {lat['control_collectives']} | {lat['host_blocking_waits']} | {lat['latency_floor_s'] * 1e3:.0f} ms "
              f"| {lat['store_ops_per_s_total']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
