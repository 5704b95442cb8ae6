"""Host memory of the exports users call on a sharded transformers model: ``model.save_pretrained`` written by
byte ranges (every rank its own pieces: ``integrations/_ranged_save.py``) vs the rank-0 gather it replaced.

    .venv/bin/python benchmarks/bench_export_memory.py [--model medium|1b] [--world 2] [--path ranged|gather]
                                                       [--export hf|lightning]

Each rank builds the Llama on the meta device and ``fp.shard`` materializes its own shard (so building never
holds the whole model), then saves with ``max_shard_size="500MB"``. Per rank: the shard (bytes of the pieces it
writes), growth of the malloc heap peak (LD_PRELOAD counter from ``_mem``, the CPU analogue of
``max_memory_allocated``) and of the RSS high-water mark during the save, as a percentage of the shard.
``--export lightning`` writes Lightning's ``state_dict_type="full"`` file instead (``torch_file.write_sharded``;
with ``--path gather``: the old ``write_on_rank0`` + ``torch_file.write``). ``--path gather`` forces the old path (``fp.full_state_dict`` to rank 0, the library writes there). Prints one
line per rank and the load average; noisy on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import _mem

MODELS = {  # LlamaConfig keywords
    "medium": {"vocab_size": 32768, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
               "num_attention_heads": 12, "num_key_value_heads": 12, "tie_word_embeddings": True},   # 0.11 B
    "1b": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},       # 1.24 B
}


def _save(model, out: str, export: str, path: str) -> None:
    from pathlib import Path

    from fsdp_plugin.integrations._rank0_save import write_on_rank0
    from fsdp_plugin.integrations.lightning.checkpoint import torch_file

    if export == "hf":
        model.save_pretrained(out, max_shard_size="500MB")
    elif path == "gather":
        write_on_rank0(model, lambda sd: torch_file.write(Path(out) / "full.ckpt", sd, {"epoch": 1}, {}), "bench")
    else:
        torch_file.write_sharded(Path(out) / "full.ckpt", model, {"epoch": 1}, {})


def _rank(rank, world, model_name, path, out, export):
    import fsdp_plugin.integrations.transformers as integration
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp_plugin as fp
    from fsdp_plugin.checkpoint.hf import export_plan
    from fsdp_plugin.checkpoint._model import param_shards

    integration.install()
    if path == "gather":
        export_plan.plan = lambda files, sources: (None, "forced by --path gather")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**MODELS[model_name], max_position_embeddings=64))
    fp.shard(model)
    shard = sum((sh.end - sh.start) * sh.dtype.itemsize for sh in param_shards(model) if sh.writer)
    heap = _mem.Heap()
    import gc
    gc.collect()
    h0, r0 = heap.reset_peak(), _mem.rss()
    _mem.reset_rss_peak()
    t = time.perf_counter()
    _save(model, out, export, path)
    wall = time.perf_counter() - t
    return {"rank": rank, "shard": shard, "heap": heap.peak() - h0 if heap.available else -1,
            "rss": _mem.rss_peak() - r0, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="medium")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--path", choices=("ranged", "gather"), default="ranged")
    ap.add_argument("--export", choices=("hf", "lightning"), default="hf")
    ap.add_argument("--dir", default=None, help="output folder (default: a temporary one, removed)")
    args = ap.parse_args()
    lib = _mem.build_heap_tracker()
    if lib and "libheaptrack" not in os.environ.get("LD_PRELOAD", ""):  # re-exec with the heap counter
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": lib})
    from _dist import run_ranks

    out = args.dir or tempfile.mkdtemp(prefix="bench_export_")
    try:
        res = run_ranks(_rank, args.world, args.model, args.path, out, args.export, timeout=3000)
    finally:
        if args.dir is None:
            shutil.rmtree(out, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    for r in res:
        gb = 1e9
        print(f"{args.model} world={args.world} export={args.export} path={args.path} rank={r['rank']}: shard {r['shard'] / gb:.3f} GB, "
              f"heap peak +{r['heap'] / gb:.3f} GB ({100 * r['heap'] / r['shard']:.1f}% of shard), RSS peak "
              f"+{r['rss'] / gb:.3f} GB ({100 * r['rss'] / r['shard']:.1f}%), save {r['wall']:.1f} s; "
              f"load {' '.join(load)}")


if __name__ == "__main__":
    main()
