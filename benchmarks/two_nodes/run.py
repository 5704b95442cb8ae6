"""The two-node benchmark: every (link rate, processes per node) of the campaign through netns.sh, then a table.

    sudo .venv/bin/python benchmarks/two_nodes/run.py --preset small --rates none,1gbit,200mbit --per-node 1,2
    .venv/bin/python benchmarks/two_nodes/run.py --table benchmarks/two_nodes/results_small.jsonl

Exit 77 (with the reason) where namespaces are unavailable (not root, a container without CAP_SYS_ADMIN).
Paired ratio: per round, a configuration's step time over hybrid_shard's in the same round; the median is shown.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from configs import BASELINE  # noqa: E402


def campaign(a) -> int:
    out, failed = Path(a.out).resolve(), []
    for rate in a.rates.split(","):
        for k in a.per_node.split(","):
            extra = " ".join(f"--extra '{e}'" for e in a.extra)
            cmd = (f"LD_PRELOAD={a.heap or ''} {sys.executable} -m torch.distributed.run --nnodes 2 "
                   f"--nproc_per_node {k} --node_rank $NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT "
                   f"{HERE / 'worker.py'} --preset {a.preset} --configs {a.configs} --steps {a.steps} "
                   f"--rounds {a.rounds} --batch {a.batch} --out {out} {extra}"
                   + (" --calibrate" if rate == "none" else ""))
            print(f"== rate={rate} nodes=2 x {k}", flush=True)
            r = subprocess.run([str(HERE / "netns.sh"), "--rate", rate, "--timeout", str(a.timeout), "--", cmd],
                               capture_output=True, text=True)
            print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
            if r.returncode == 77:
                return 77
            if r.returncode != 0:      # go on with the other links, but the campaign did not succeed
                failed.append(f"rate={rate} 2 x {k}: exit {r.returncode}")
    for f in failed:
        print(f"FAILED {f}; both nodes' full logs: rerun that row with netns.sh --logs DIR", file=sys.stderr)
    return 1 if failed else 0


def table(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lines = ["| preset | nodes×ranks | link | config | step s (median) | ratio vs hybrid (paired median) | "
             "link MB/node/step | comm_stats inter MB/node/step | step heap peak MB |", "|" + "---|" * 9]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["preset"], r["per_node"], r["rate"]), {})[r["config"]] = r
    for (preset, k, rate), by in groups.items():
        base = by.get(BASELINE)
        for name, r in by.items():
            steps = [x["step_s"] for x in r["rounds"]]
            ratio = "-"
            if base is not None:
                ratio = f"{statistics.median(x['step_s'] / b['step_s'] for x, b in zip(r['rounds'], base['rounds'])):.2f}"
            link = statistics.median(sum(x["link_tx_per_node"]) / max(len(x["link_tx_per_node"]), 1)
                                     for x in r["rounds"]) / 1e6
            inter = statistics.median(x["inter_bytes_per_node"] for x in r["rounds"]) / 1e6
            peak = max(x["peak_bytes"] for x in r["rounds"]) / 2**20
            lines.append(f"| {preset} | 2×{k} | {rate} | {name} | {statistics.median(steps):.3f} | {ratio} | "
                         f"{link:.1f} | {inter:.1f} | {peak:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--rates", default="none,1gbit,200mbit")
    p.add_argument("--per-node", default="1,2")
    p.add_argument("--configs", default="full_shard,shard_grad_op,hybrid_shard,hpz,hybrid_q8g,zeropp,full_q8")
    p.add_argument("--extra", action="append", default=[], help="name={json ShardingConfig kwargs}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--timeout", type=int, default=1500)
    p.add_argument("--out", default=str(HERE / "results.jsonl"))
    p.add_argument("--table", help="only print the table of this results file")
    a = p.parse_args()
    if a.table:
        print(table(a.table))
        return 0
    sys.path.insert(0, str(HERE.parent))
    from _mem import build_heap_tracker
    a.heap = build_heap_tracker()
    rc = campaign(a)
    if rc == 0 and os.path.exists(a.out):
        print(table(a.out))
    return rc


if __name__ == "__main__":
    sys.exit(main())
