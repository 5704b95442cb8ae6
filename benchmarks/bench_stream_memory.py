"""Host memory of ``fp.iter_full_params`` (RL weight sync): the peak while streaming vs the largest unit.

    .venv/bin/python benchmarks/bench_stream_memory.py [--model medium|1b] [--world 2] [--dtype fp32|bf16]
                                                       [--ranks 0|all]

Each rank builds the Llama on the meta device and ``fp.shard`` materializes its own shard, then iterates the
whole stream (HF names) while the asking ranks touch every tensor (a stand-in for sending it). Per rank: the
largest unit's full bytes (master dtype), growth of the malloc heap peak (LD_PRELOAD counter from ``_mem``) and
of the RSS high-water mark during the stream, as multiples of the largest unit; the bound is 1.2x. Prints one
line per rank and the load average.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import _mem
from bench_export_memory import MODELS


def _rank(rank, world, model_name, dtype_name, ranks):
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp_plugin as fp
    from fsdp_plugin.checkpoint._model import stream_units

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**MODELS[model_name], max_position_embeddings=64))
    fp.shard(model)
    unit = max(sum(h.padded * h.dtype.itemsize for h in hs) for hs in stream_units(model))
    dtype = {"fp32": None, "bf16": torch.bfloat16}[dtype_name]
    heap = _mem.Heap()
    gc.collect()
    h0, r0 = heap.reset_peak(), _mem.rss()
    _mem.reset_rss_peak()
    t, n, total = time.perf_counter(), 0, 0
    for name, tensor in fp.iter_full_params(model, dtype=dtype, ranks="all" if ranks == "all" else (0,)):
        n += 1
        total += tensor.numel() * tensor.element_size()
        float(tensor.reshape(-1)[-1])            # touch it
    wall = time.perf_counter() - t
    return {"rank": rank, "unit": unit, "heap": heap.peak() - h0 if heap.available else -1,
            "rss": _mem.rss_peak() - r0, "wall": wall, "n": n, "bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="medium")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--ranks", choices=("0", "all"), default="0")
    args = ap.parse_args()
    lib = _mem.build_heap_tracker()
    if lib and "libheaptrack" not in os.environ.get("LD_PRELOAD", ""):  # re-exec with the heap counter
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": lib})
    from _dist import run_ranks

    res = run_ranks(_rank, args.world, args.model, args.dtype, args.ranks, timeout=3000)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    gb = 1e9
    for r in res:
        print(f"{args.model} world={args.world} dtype={args.dtype} ranks={args.ranks} rank={r['rank']}: largest unit "
              f"{r['unit'] / gb:.3f} GB; heap peak +{r['heap'] / gb:.3f} GB ({r['heap'] / r['unit']:.2f}x), RSS peak "
              f"+{r['rss'] / gb:.3f} GB ({r['rss'] / r['unit']:.2f}x); yielded {r['n']} tensors "
              f"{r['bytes'] / gb:.3f} GB in {r['wall']:.1f} s; load {' '.join(load)}")


if __name__ == "__main__":
    main()
