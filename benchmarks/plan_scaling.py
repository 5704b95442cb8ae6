"""The FSDP paper's scaling story, simulated with `fp.plan`: memory per GPU and per-GPU throughput against
the number of GPUs, for decoder-only models of 0.6 B to 175 B parameters.

    python benchmarks/plan_scaling.py [--hardware a100-80gb] [--out benchmarks/plan_scaling.json]
    python3 benchmarks/plan_scaling_plot.py benchmarks/plan_scaling.json    # PNGs (needs matplotlib only)

Hardware numbers are named inputs (`fsdp_plugin.planner.HARDWARE`: sustained matmul FLOP/s, memory bandwidth,
per-GPU ring bandwidth inside a node and across nodes). Models are GPT-style decoders sized like the paper's
(T5-611M, T5-2.28B, T5-11B are encoder-decoders; we match the parameter count, not the architecture; GPT-175B
is GPT-3's shape). full_shard, bf16 parameters with fp32 reduction, AdamW, activation checkpointing per block,
one sequence of 2048 tokens per GPU (B=1), backward prefetch on. Activations come from one fake
forward+backward (CPU kernels: the planner runs without a GPU here).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from _model import GPT, Block, GPTConfig  # noqa: E402

MODELS = {   # name: (layers, d_model, heads, vocab)
    "0.6B (T5-611M size)": (30, 1280, 20, 32128),
    "2.3B (T5-2.28B size)": (28, 2560, 32, 32128),
    "11B (T5-11B size)": (56, 4096, 32, 32128),
    "175B (GPT-175B)": (96, 12288, 96, 50257),
}
WORLDS = [8, 16, 32, 64, 128, 256, 512]
SEQ, BATCH = 2048, 1


def simulate(name, hardware):
    import fsdp_plugin as fp

    n_layer, d, h, vocab = MODELS[name]
    cfg = GPTConfig(n_layer=n_layer, d_model=d, n_head=h, vocab=vocab, seq_len=SEQ)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    t0 = time.time()
    plan = fp.plan(lambda: GPT(cfg), world_size=WORLDS, sharding_strategy="full_shard", auto_wrap_policy={Block},
                   optimizer="adamw", inputs=lambda: (ids, ids), mixed_precision="bf16",
                   activation_checkpointing=True, calibration=hardware, device="cuda")
    rows = []
    for w in WORLDS:
        wp = plan.worlds[w]
        rows.append({"world": w, "peak_bytes": wp.peak, "param_shards": wp.param_shards,
                     "optimizer_state": wp.optimizer_state, "activations": wp.activations,
                     "unsharded": wp.unsharded_params, "step_s": wp.step_s, "compute_s": wp.compute_s,
                     "comm_s": wp.comm_s, "wire_bytes": wp.wire_total,
                     "tflops_per_gpu": plan.flops_per_step / wp.step_s / 1e12})
    print(f"{name}: {plan.num_params / 1e9:.2f} B params, planned in {time.time() - t0:.1f} s", flush=True)
    for r in rows:
        print(f"  world {r['world']:4d}: peak {r['peak_bytes'] / 2**30:7.2f} GiB, step {r['step_s']:.3f} s, "
              f"{r['tflops_per_gpu']:.0f} TFLOP/s per GPU (comm {r['comm_s']:.3f} s)", flush=True)
    return {"model": name, "num_params": plan.num_params, "flops_per_step": plan.flops_per_step, "rows": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--out", default=str(HERE / "plan_scaling.json"))
    p.add_argument("--models", nargs="*", default=list(MODELS))
    a = p.parse_args()
    from fsdp_plugin.planner import HARDWARE

    out = {"hardware": a.hardware, "hardware_inputs": HARDWARE[a.hardware], "seq": SEQ, "batch_per_gpu": BATCH,
           "models": [simulate(m, a.hardware) for m in a.models]}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
