"""The host optimizer step of cpu_offload (issue 49): torch's default AdamW loop against its fused CPU kernel (what
the engine switches an offloaded torch AdamW to), on one flat fp32 shard, with the machine's load recorded.

    python benchmarks/offload_optim_step.py [--params 100e6,300e6] [--steps 3] [--out benchmarks/results_offload_optim_step.json]

A 1.24 B-parameter shard (Llama-3.2-1B) needs ~20 GB (params, grads, 2 moments) plus the default loop's two
full-size temporaries: too much beside other jobs on a 24 GiB machine, so a smaller shard is timed and the time
scaled linearly to 1.24 B (both kernels stream memory: time per parameter is flat once the shard is far beyond the
caches). Bytes per parameter: fused = read p, g, m, v + write p, m, v = 28 B; the default single-tensor loop's
passes as torch runs them (planner/_optim.py: 80 B for AdamW, plus two freshly allocated full-size temporaries).
The engine's host allocator settings (``_build/host_alloc.py``, applied under cpu_offload) are applied first, as
in training.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fsdp_plugin._build.host_alloc import keep_freed_host_memory  # noqa: E402

LLAMA_1B = 1_235_814_400
BYTES_PER_PARAM = {"default": 80, "fused": 28}


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def time_steps(n: int, fused: bool, steps: int) -> dict:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True if fused else None)
    opt.step()      # state allocated (first step, not timed)
    times, faults = [], []
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    kind = "fused" if fused else "default"
    best = min(times)
    return {"kind": kind, "params": n, "step_s": times, "best_s": best, "page_faults": faults,
            "bytes_per_param": BYTES_PER_PARAM[kind], "gb_per_s": BYTES_PER_PARAM[kind] * n / best / 1e9,
            "scaled_to_llama_1b_s": best * LLAMA_1B / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="100e6,300e6", help="comma-separated shard sizes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results_offload_optim_step.json"))
    args = ap.parse_args()
    sizes = [int(float(v)) for v in args.params.split(",")]
    host_alloc = keep_freed_host_memory()
    rows = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or
            platform.machine(), "host_alloc_applied": host_alloc, "loadavg_before": loadavg(), "runs": []}
    rows["speedup"] = {}
    for n in sizes:
        pair = []
        for fused in (False, True):
            r = time_steps(n, fused, args.steps)
            r["loadavg_after"] = loadavg()
            rows["runs"].append(r)
            pair.append(r)
            print(f"{r['kind']:>7}: {n / 1e6:.0f} M params, best {r['best_s'] * 1e3:.0f} ms "
                  f"({r['gb_per_s']:.1f} GB/s at {r['bytes_per_param']} B/param), "
                  f"scaled to 1.24 B: {r['scaled_to_llama_1b_s']:.2f} s; faults/step {r['page_faults']}; "
                  f"load {r['loadavg_after']}", flush=True)
        rows["speedup"][str(n)] = pair[0]["best_s"] / pair[1]["best_s"]
        print(f"fused is {rows['speedup'][str(n)]:.2f}x the default loop at {n / 1e6:.0f} M", flush=True)
    with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
