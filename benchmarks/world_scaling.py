"""Issue 30: how every per-step cost grows with the world size, with the pairing check on and off.

    python benchmarks/world_scaling.py [--presets tiny small] [--worlds 2 4 8 16] [--steps 6]

For each preset, world size and strategy (hybrid: (2, N/2)), one forked run (the tests' harness: gloo,
FileStore) alternates two arms every step: ``on`` (the engine as shipped, ``pairing_check="auto"``) and
``off`` (the root's pairing switched to "off": FSDP2's behaviour). Per step and arm it records, on every rank,
the collective calls and ring bytes by kind (``fp.comm_stats``), host-blocking cross-rank waits by kind
(``fp.sync_stats``), and the status thread's store operations (``status.STORE_OPS``, per second of run); time
only as the paired on/off ratio (median of adjacent-step ratios, slowest rank), since 16 processes on a
shared 2-core machine make absolute times meaningless. Load-independent numbers first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def _rank(rank, world, preset, strategy, steps):
    import torch
    import torch.distributed as dist

    import fsdp_plugin as fp
    from _model import GPT, PRESET_BATCH, PRESETS, Block, GPTConfig
    from fsdp_plugin._comm import status

    cfg = GPTConfig(**PRESETS[preset])
    torch.manual_seed(0)
    mesh = (2, world // 2) if strategy == "hybrid_shard" else None
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh)
    root = model._fp_root
    on_mode = root.pairing
    opt = torch.optim.AdamW(model.parameters())
    per = max(PRESET_BATCH[preset] // world, 1)
    x = torch.randint(0, cfg.vocab, (per, cfg.seq_len), generator=torch.Generator().manual_seed(rank))
    rec = {"on": [], "off": []}
    ops0, t_start = status.STORE_OPS[0], time.time()
    for step in range(2 + 2 * steps):
        arm = ("on", "off")[step % 2]
        root.pairing = on_mode if arm == "on" else "off"
        root.tagged = root.pairing == "tags"
        fp.comm_stats.reset()
        fp.sync_stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        calls, nbytes = dict(fp.comm_stats.calls), dict(fp.comm_stats.bytes)
        waits = dict(fp.sync_stats.waits)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= 2:
            rec[arm].append((dt.item(), calls, nbytes, waits))
    store_rate = (status.STORE_OPS[0] - ops0) / max(time.time() - t_start, 1e-9)
    return {"mode": on_mode, "rec": rec, "store_ops_per_s": store_rate, "period": status.period()}


def _summary(results: list) -> dict:
    r0 = results[0]
    out = {"mode": r0["mode"]}
    for arm in ("on", "off"):
        _, calls, nbytes, waits = r0["rec"][arm][-1]
        out[arm] = {"calls": sum(calls.values()), "control": calls.get("control", 0),
                    "bytes": sum(nbytes.values()), "waits": sum(waits.values())}
    ratios = [a[0] / b[0] for a, b in zip(r0["rec"]["on"], r0["rec"]["off"])]
    out["time_ratio"] = statistics.median(ratios)
    out["store_ops_per_s_rank"] = statistics.mean(r["store_ops_per_s"] for r in results)
    out["period"] = r0["period"]
    return out


def main() -> None:
    from _dist import run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--steps", type=int, default=6, help="timed steps per arm")
    a = ap.parse_args()
    print(f"load {os.getloadavg()}; per step, rank 0; on = pairing_check='auto', off = no check")
    print("| preset | strategy | N | check | calls on/off | control on/off | bytes on/off | blocking waits on/off "
          "| store ops/s per rank (period) | time on/off (paired median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for preset in a.presets:
        for strategy in a.strategies:
            for world in a.worlds:
                if strategy == "hybrid_shard" and world < 4:
                    continue
                s = _summary(run_ranks(_rank, world, preset, strategy, a.steps, timeout=900))
                on, off = s["on"], s["off"]
                print(f"| {preset} | {strategy} | {world} | {s['mode']} | {on['calls']}/{off['calls']} "
                      f"| {on['control']}/{off['control']} | {on['bytes']:,}/{off['bytes']:,} "
                      f"| {on['waits']}/{off['waits']} | {s['store_ops_per_s_rank']:.2f} ({s['period']:.1f} s) "
                      f"| {s['time_ratio']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
