"""CUDA checks for the engine, run on a machine with GPUs (one command, prints a summary).

    python benchmarks/gpu/parity.py [--dry]   # min(#GPUs, 4) NCCL ranks (1 GPU: world 1); --dry: 2 gloo CPU ranks

1. parity: fp32 full_shard vs one-process training on the global batch (max loss / param diff),
   and bf16 (MixedPrecision) vs a same-casts reference;
2. overlap: step time with and without backward/forward prefetch (median of 10 steps);
3. offload: cpu_offload=True trains and matches the non-offloaded run;
4. peak CUDA memory per rank for each run.
Prints one JSON line per check and a summary table; exit code 1 if a parity check fails.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import fsdp_plugin as fp  # noqa: E402
from _parity import same_casts_reference  # noqa: E402
from models import GPT, Block, gpt_batch  # noqa: E402

STEPS = 10
SIZE = dict(vocab=512, d=256, n_layer=4, seq=64)


def batch(step, rank, device):
    x, y = _cpu_batch(step, rank)
    return x.to(device), y.to(device)


def reference(world, device, dtype=None):
    model = functools.partial(GPT, **SIZE)
    return same_casts_reference(world, STEPS, dtype, model_fn=model, batch_fn=_cpu_batch, device=device)[0]


def _cpu_batch(step, rank):
    return gpt_batch(step, rank, batch=4, seq=SIZE["seq"], vocab=SIZE["vocab"])


def run(rank, world, device, **cfg):
    torch.manual_seed(0)
    model = fp.shard(GPT(**SIZE), auto_wrap_policy={Block}, device=device, **cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for s in range(STEPS):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model(*batch(s, rank, device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        t = loss.detach().float()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, statistics.median(times[2:]), torch.cuda.max_memory_allocated(device) if cuda else 0


def worker(rank, world, store_path, out_path, dry=False):
    if dry:
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    bf16 = fp.MixedPrecision(param_dtype=torch.bfloat16)
    runs = {
        "fp32": dict(),
        "bf16": dict(mixed_precision=bf16),
        "no_prefetch": dict(backward_prefetch=False, forward_prefetch=False),
        "forward_prefetch": dict(forward_prefetch=True),
        "cpu_offload": dict(cpu_offload=True),
    }
    results = {name: run(rank, world, device, **cfg) for name, cfg in runs.items()}
    if rank == 0:
        ref32, ref16 = reference(world, device), reference(world, device, torch.bfloat16)
        rows = []
        for name, (losses, step_s, peak) in results.items():
            ref = ref16 if name == "bf16" else ref32
            rows.append({"check": name, "world": world, "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref)),
                         "step_ms": round(step_s * 1e3, 2), "peak_mib": round(peak / 2**20, 1)})
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main():
    dry = "--dry" in sys.argv
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (or --dry)")
        return 0
    world = 2 if dry else min(torch.cuda.device_count(), 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(world, os.path.join(tmp, "store"), out, dry), nprocs=world)
        rows = json.load(open(out))
    ok = True
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if not dry else 'CPU (dry)'}, world {world}")
    print(f"{'check':<18}{'max loss diff':>15}{'step ms':>10}{'peak MiB':>10}")
    for r in rows:
        print(f"{r['check']:<18}{r['max_loss_diff']:>15.2e}{r['step_ms']:>10}{r['peak_mib']:>10}")
        print("GPU_CHECK_JSON " + json.dumps(r))
        ok &= r["max_loss_diff"] <= 1e-4
    base = {r["check"]: r for r in rows}
    speed = base["no_prefetch"]["step_ms"] / max(base["fp32"]["step_ms"], 1e-9)
    print(f"prefetch speed-up (no_prefetch / default step time): {speed:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
