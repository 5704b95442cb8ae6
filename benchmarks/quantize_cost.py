"""What quantizing and dequantizing cost per element, and as bytes of elementwise traffic at the calibrated
elementwise rate (``fp.planner.calibrate``'s ``elementwise_bytes_per_s``): why the planner measures the
quantization's own rates (``Calibration.quantize_s_per_elem`` / ``dequantize_s_per_elem``) instead of deriving
them from the elementwise rate (the equivalent bytes per element change with the row size: cache effects).

    python benchmarks/quantize_cost.py [--sizes 1048576,4194304]

One thread, one process: run it on a quiet machine (the load is printed); best of 5 trials per kernel.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import fsdp_plugin as fp
from fsdp_plugin._build.host_alloc import keep_freed_host_memory
from fsdp_plugin._comm import quantized as qz


def _best(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(5):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1048576,4194304,8388608")
    p.add_argument("--block", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(1)
    keep_freed_host_memory()          # as under fp.shard: freed buffers reused, not page-faulted back
    rate = fp.planner.calibrate(torch.device("cpu"), seconds=0.3).elementwise_bytes_per_s
    print(f"load {os.getloadavg()[0]:.1f}; elementwise rate {rate / 1e9:.2f} GB/s; block {a.block}")
    rows = {"quantize (nearest)": [], "quantize (stochastic)": [], "dequantize": []}
    for n in (int(s) for s in a.sizes.split(",")):
        x = torch.randn(n)
        payload = qz.quantize(x.view(1, -1), a.block)
        per = {"quantize (nearest)": _best(lambda: qz.quantize(x.view(1, -1), a.block)),
               "quantize (stochastic)": _best(lambda: qz.quantize(x.view(1, -1), a.block, stochastic=True)),
               "dequantize": _best(lambda: qz.dequantize(payload, n, a.block))}
        for k, s in per.items():
            rows[k].append(s * rate / n)
        print(f"{n:>9} elements: " + ", ".join(f"{k} {s * 1e3:.2f} ms = {s * rate / n:.1f} B/elem"
                                               for k, s in per.items()))
    print("median B/elem: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
