"""Issue 31 item 5: 2 dp × 2 tp against 4 × 1 on the medium preset (peak memory per rank) and against torch
FSDP2 + the same TP plan (step time), all in one run on the same 4 ranks.

    python benchmarks/tp_medium.py [--preset medium --steps 4 --rounds 3]

The three layouts are built side by side in the same 4 forked gloo ranks (tests/_dist.run_ranks) and trained
in interleaved rounds (A B C, A B C, ...), so machine load hits them alike; step time is the slowest rank's,
ratios are paired per round. TP plan (both engines): each block's MLP, ``fc`` colwise and ``proj`` rowwise
(the attention's fused ``qkv`` stays replicated over TP: splitting it needs a head-aware plan). Peak = the
step's malloc peak above the resident models, and each model's resident bytes (built and warmed up alone) (the LD_PRELOAD heap tracker of benchmarks/_mem.py; the script
re-runs itself under it), the max over ranks. AdamW, batch per dp rank ``--batch`` sequences.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from _mem import Heap, build_heap_tracker  # noqa: E402
from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402

LAYOUTS = ("ours 4x1", "ours 2x2", "fsdp2 2x2")


def _mlp_plan(cfg):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {f"blocks.{i}.{n}": s for i in range(cfg.n_layer)
            for n, s in (("fc", ColwiseParallel()), ("proj", RowwiseParallel()))}


def _build(layout: str, cfg, mesh):
    import fsdp_plugin as fp
    from torch.distributed.tensor.parallel import parallelize_module
    model = GPT(cfg)
    if layout == "ours 4x1":
        fp.shard(model, auto_wrap_policy={Block})
    elif layout == "ours 2x2":
        parallelize_module(model, mesh["tp"], _mlp_plan(cfg))
        fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={Block})
    else:                       # the baseline: torch's FSDP2 over dp after the same TP plan
        from torch.distributed.fsdp import fully_shard
        parallelize_module(model, mesh["tp"], _mlp_plan(cfg))
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _batch(step: int, dp_rank: int, cfg, per: int):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    data = torch.randint(0, cfg.vocab, (per, cfg.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _round(model, opt, layout, cfg, a, rank, step0, heap) -> dict:
    import torch.distributed as dist
    dp_rank = rank if layout == "ours 4x1" else rank // 2
    per = a.batch if layout != "ours 4x1" else max(a.batch // 2, 1)   # the same global batch: 2 dp ranks × batch
    dist.barrier()
    live = heap.live()
    heap.reset_peak()
    t0 = time.perf_counter()
    for s in range(a.steps):
        model(*_batch(step0 + s, dp_rank, cfg, per)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    vec = torch.tensor([(time.perf_counter() - t0) / a.steps, float(heap.peak() - live if heap.available else -1)],
                       dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return {"step_s": vec[0].item(), "peak_bytes": vec[1].item()}


def worker(rank, world, a):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    cfg, heap = GPTConfig(**PRESETS[a.preset]), Heap()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layout in ("ours 4x1", "ours 2x2"):     # throwaway: the process's one-time heap (runtime caches, gloo
        torch.manual_seed(0)                    # pairs, pools) is not charged to whichever layout comes first
        m, opt = _build(layout, cfg, mesh)
        _round(m, opt, layout, cfg, argparse.Namespace(**{**vars(a), "steps": 1}), rank, 0, heap)
        del m, opt
    models, resident = {}, {}
    for layout in LAYOUTS:      # built and warmed up one after another: resident = its shards + AdamW state
        live = heap.live()
        torch.manual_seed(0)
        models[layout] = m, opt = _build(layout, cfg, mesh)
        _round(m, opt, layout, cfg, argparse.Namespace(**{**vars(a), "steps": 1}), rank, 0, heap)
        held = torch.tensor([float(heap.live() - live)], dtype=torch.float64)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        resident[layout] = held.item()
    rows = {k: [] for k in LAYOUTS}
    for r in range(a.rounds):
        for layout, (m, opt) in models.items():
            rows[layout].append(_round(m, opt, layout, cfg, a, rank, 10 + r * a.steps, heap))
    dist.barrier()
    return rows, resident


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="sequences per dp rank of the 2 x 2 layouts")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    tracker = build_heap_tracker()
    if tracker and tracker not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = tracker
        os.execv(sys.executable, [sys.executable, *sys.argv])
    from _dist import run_ranks
    rows, resident = run_ranks(worker, 4, a, timeout=3600)[0]
    print(f"preset {a.preset}, world 4, {a.rounds} rounds x {a.steps} steps, load {os.getloadavg()}")
    print("| layout | step s (median) | ratio vs ours 2x2 (paired median) | resident MB (shards + AdamW, rank max) | "
          "step heap peak MB above it (rank max) |")
    print("|---|---|---|---|---|")
    base = rows["ours 2x2"]
    for layout, rs in rows.items():
        ratio = statistics.median(x["step_s"] / b["step_s"] for x, b in zip(rs, base))
        print(f"| {layout} | {statistics.median(x['step_s'] for x in rs):.3f} | {ratio:.2f} | "
              f"{resident[layout] / 2**20:.0f} | {max(x['peak_bytes'] for x in rs) / 2**20:.0f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"preset": a.preset, "rows": rows, "resident": resident}, indent=1))


if __name__ == "__main__":
    main()
