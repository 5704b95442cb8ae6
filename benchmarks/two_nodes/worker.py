"""One node's ranks of the two-node benchmark (started by torchrun in each namespace; see run.py).

Every configuration is sharded once (all resident), then trained in rounds, configurations interleaved
(A B C D, A B C D, ...), so that load changes hit them alike and ratios are paired by round. Per configuration
and round: step time (slowest rank, mean over the round's steps), bytes this node sent on the link (the veth's
tx counter, local rank 0), ``fp.comm_stats`` inter-/intra-node bytes (summed over the node's ranks), and the
step's heap peak above the resident models (rank-max; needs the LD_PRELOAD heap tracker of benchmarks/_mem.py).
Rank 0 writes one JSON line per configuration to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import fsdp_plugin as fp  # noqa: E402
from _mem import Heap  # noqa: E402
from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402
from configs import CONFIGURATIONS, parse_extra, preset_layer, resolve, spec_json  # noqa: E402


def link_tx() -> int:
    iface = os.environ.get("NODE_IFACE")
    if not iface:
        return 0
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def batch(step: int, rank: int, cfg: GPTConfig, per_rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, cfg.vocab, (per_rank, cfg.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def one_round(model, opt, cfg, a, rank, step0, heap) -> dict:
    fp.comm_stats.reset()
    dist.barrier()
    live, tx0 = heap.live(), link_tx()
    heap.reset_peak()
    t0 = time.perf_counter()
    for s in range(a.steps):
        model(*batch(step0 + s, rank, cfg, a.batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dt = (time.perf_counter() - t0) / a.steps
    peak = heap.peak() - live if heap.available else -1
    stats = fp.comm_stats
    inter = sum(v for k, v in stats.inter_node_bytes.items() if k != "control")
    intra = sum(v for k, v in stats.intra_node_bytes.items() if k != "control")
    local = int(os.environ.get("LOCAL_RANK", 0)) == 0
    dist.barrier()
    tx = link_tx() - tx0 if local else 0
    vec = torch.tensor([dt, float(peak)], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    sums = torch.tensor([inter / a.steps, intra / a.steps], dtype=torch.float64)
    dist.all_reduce(sums)
    txs = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    txs[rank] = tx / a.steps
    dist.all_reduce(txs)
    return {"step_s": vec[0].item(), "peak_bytes": vec[1].item(), "inter_bytes_per_node": sums[0].item() / 2,
            "intra_bytes_per_node": sums[1].item() / 2, "link_tx_per_node": [t for t in txs.tolist() if t > 0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--configs", default=",".join(CONFIGURATIONS))
    p.add_argument("--extra", action="append", default=[])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--out", required=True)
    p.add_argument("--calibrate", action="store_true",
                   help="measure fp.planner.calibrate side by side first (predict.py's planner column)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1200))
    rank = dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    table = {**CONFIGURATIONS, **parse_extra(a.extra)}
    names = [n for n in a.configs.split(",") if n]
    cfg, heap = GPTConfig(**PRESETS[a.preset]), Heap()
    layer = preset_layer(cfg, a.batch)       # the preset's own shapes (§ 35d)
    cal = fp.planner.calibrate(torch.device("cpu"), seconds=0.3, layer=layer).to_dict() if a.calibrate else None
    models = {}
    for name in names:
        kw = resolve(table[name], per_node)
        model = fp.shard(GPT(cfg), auto_wrap_policy={Block}, **kw)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), kw)
    for name, (model, opt, _) in models.items():          # warm-up: connections, allocator, recorded order
        one_round(model, opt, cfg, argparse.Namespace(**{**vars(a), "steps": 1}), rank, 0, heap)
    rows = {n: [] for n in names}
    for r in range(a.rounds):
        for name, (model, opt, _) in models.items():
            rows[name].append(one_round(model, opt, cfg, a, rank, 10 + r * a.steps, heap))
    if rank == 0:
        with open(a.out, "a") as f:
            for name in names:
                f.write(json.dumps({"config": name, "kwargs": {k: str(v) for k, v in models[name][2].items()},
                                    "spec": spec_json(table[name]),
                                    "preset": a.preset, "nodes": 2, "per_node": per_node,
                                    "rate": os.environ.get("LINK_RATE", "none"), "steps": a.steps,
                                    "batch_per_rank": a.batch, "rounds": rows[name], "calibration": cal}) + "\n")
    fp.shutdown()


if __name__ == "__main__":
    main()
