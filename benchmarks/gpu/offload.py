"""Issue 49: cpu_offload on one GPU, ours against torch FSDP2's ``CPUOffloadPolicy`` (the baseline, benchmarks only).

    python benchmarks/gpu/offload.py          # on a CUDA machine (one GPU)
    python benchmarks/gpu/offload.py --dry    # the same rows on CPU, tiny model, gloo world 1 (our offload path
                                              # through the copier's CPU test backend; FSDP2 unpinned)

Rows (one ``GPU_CHECK_JSON {...}`` line each; exit 0 when every row ran and parity holds):

1. ``bandwidth``: 1 GiB fp32 host->device and device->host copies, pinned vs pageable (and pageable into a fresh
   tensor each time, as the engine did before), GB/s; the kernel's THP mode;
2. ``ours_offload`` / ``ours_no_offload`` / ``fsdp2_offload``: Llama-3.2-1B shape (1.24 B parameters, tied
   embedding), 4 x 2048 tokens, bf16 compute, fp32 masters, ``torch.optim.AdamW(lr=1e-4)`` as users write it:
   step time split into forward, backward (our gradient copies and their one wait included) and optimizer step,
   synchronized; page faults per step (``ru_minflt``); peak GPU memory; the copier's counted bytes and host waits;
3. ``gpu_adamw``: the device AdamW step (foreach, fp32) over the same 1.24 B parameters alone: bytes/s at the
   planner's 80 B/param (its device optimizer term);
4. ``parity``: a small Llama-shaped model in fp32, ours with and without offload, same AdamW: max loss and parameter
   difference after 3 steps (<= 1e-5: the host's fused CPU kernel against the device's kernel).

Budget: ~100 s on one H200 (the 120 s cap of benchmarks/gpu_check.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.testing import fake

LLAMA_1B = dict(vocab=128256, d=2048, n_layer=16, n_head=32, n_kv=8, ffn=8192)
TINY = dict(vocab=256, d=64, n_layer=2, n_head=4, n_kv=2, ffn=128)
SMALL = dict(vocab=512, d=128, n_layer=2, n_head=4, n_kv=2, ffn=256)
ROWS: list = []
MEASURED: dict = {}     # the bandwidth row's rates, for the copies' share of the offload step


def emit(check: str, ok: bool, **facts) -> None:
    row = dict(check=check, ok=bool(ok), **facts)
    ROWS.append(row)
    print("GPU_CHECK_JSON " + json.dumps(row), flush=True)


# ------------------------------------------------------------------ the model (Llama-3.2-1B's shapes, no RoPE)
class Attention(nn.Module):
    def __init__(self, d, n_head, n_kv):
        super().__init__()
        self.h, self.kv, self.hd = n_head, n_kv, d // n_head
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, n_kv * self.hd, bias=False)
        self.v = nn.Linear(d, n_kv * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, d, n_head, n_kv, ffn):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = Attention(d, n_head, n_kv)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab, d, n_layer, n_head, n_kv, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, n_head, n_kv, ffn) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(step, shape, vocab, device):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (shape[0], shape[1] + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


# ------------------------------------------------------------------ helpers
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def bandwidth(device, nbytes: int) -> None:
    t0 = time.perf_counter()
    n = nbytes // 4
    dev = torch.empty(n, device=device)
    pinned = torch.empty(n, pin_memory=device.type == "cuda")
    pageable = torch.empty(n)

    def rate(fn, reps=3):
        fn()
        sync(device)
        best = float("inf")
        for _ in range(reps):
            s = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - s)
        return round(nbytes / best / 1e9, 2)
    out = {"h2d_pinned_gb_s": rate(lambda: dev.copy_(pinned, non_blocking=True)),
           "h2d_pageable_gb_s": rate(lambda: dev.copy_(pageable)),
           "d2h_pinned_gb_s": rate(lambda: pinned.copy_(dev, non_blocking=True)),
           "d2h_pageable_gb_s": rate(lambda: pageable.copy_(dev)),
           "d2h_pageable_fresh_gb_s": rate(lambda: dev.to("cpu"))}
    MEASURED.update(out)
    emit("bandwidth", True, bytes=nbytes, thp=thp(), s=round(time.perf_counter() - t0, 1), **out)


def train(name, model, opt, shape, vocab, device, steps, copier=None, extra=None) -> dict:
    """Synchronized phases per step; the first step (allocations, the fused switch) is not in the medians."""
    phases, faults = {"forward": [], "backward": [], "optimizer": [], "step": []}, []
    losses = []
    for s in range(steps):
        x, y = batch(s, shape, vocab, device)
        if copier is not None:
            copier.stats.reset()
        f0 = minflt()
        sync(device)
        t0 = time.perf_counter()
        loss = model(x, y)
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        losses.append(loss.item())
        if s == 0:
            continue
        faults.append(minflt() - f0)
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[k].append(v)
    med = {f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in phases.items()}
    row = dict(med, faults_per_step=int(statistics.median(faults)), peak_gib=(round(peak(device) / 2**30, 2)
                                                                             if device.type == "cuda" else None),
               losses=[round(v, 5) for v in losses], **(extra or {}))
    if copier is not None:
        st = copier.stats.snapshot()
        row.update(h2d_gb=round(st["h2d_bytes"] / 1e9, 3), d2h_gb=round(st["d2h_bytes"] / 1e9, 3),
                   host_waits=st["syncs"], host_allocs=st["host_allocs"],
                   fused=all(g.get("fused") for g in opt.param_groups))
        if MEASURED.get("h2d_pinned_gb_s"):     # the copies' phase: their bytes at the measured pinned rates
            row.update(h2d_ms_at_pinned=round(st["h2d_bytes"] / MEASURED["h2d_pinned_gb_s"] / 1e6, 1),
                       d2h_ms_at_pinned=round(st["d2h_bytes"] / MEASURED["d2h_pinned_gb_s"] / 1e6, 1))
    return row


def ours(cfg, shape, device, steps, offloaded: bool, mp=True):
    free(device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(**cfg)
    kw = dict(mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16)) if mp else {}
    model = fp.shard(model, auto_wrap_policy={Layer}, device=device, cpu_offload=offloaded, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    copier = model._fp_root.offload
    build_s = time.perf_counter() - t0
    row = train("ours", model, opt, shape, cfg["vocab"], device, steps, copier,
                extra=dict(build_s=round(build_s, 1)))
    return row, model, opt


def fsdp2(cfg, shape, device, steps):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    free(device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(**cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pol = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=pol)
    fully_shard(model, mp_policy=mp, offload_policy=pol)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    build_s = time.perf_counter() - t0
    return train("fsdp2", model, opt, shape, cfg["vocab"], device, steps, extra=dict(build_s=round(build_s, 1)))


def gpu_adamw(cfg, device) -> None:
    free(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(**cfg)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()
    times = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    best = min(times)
    emit("gpu_adamw", True, params=n, step_ms=round(best * 1e3, 1), bytes_per_param=80,
         gb_per_s=round(80 * n / best / 1e9, 1), tensors=len(params))
    del model, opt, params


def parity(device, steps=3) -> None:
    cfg, shape = SMALL, (2, 64)
    runs = {}
    for offloaded in (False, True):
        free(device)
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(**cfg)
        model = fp.shard(model, auto_wrap_policy={Layer}, device=device, cpu_offload=offloaded)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({} if offloaded else {"fused": True}))
        losses = []
        for s in range(steps):
            loss = model(*batch(s, shape, cfg["vocab"], device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[offloaded] = losses, {k: v.float().cpu() for k, v in fp.full_state_dict(model).items()}
        del model, opt
    (l0, s0), (l1, s1) = runs[False], runs[True]
    dl = max(abs(a - b) for a, b in zip(l0, l1))
    dp = max((s0[k] - s1[k]).abs().max().item() for k in s0)
    emit("parity", dl <= 1e-5 and dp <= 1e-5, max_loss_diff=dl, max_param_diff=dp, steps=steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default="bandwidth,ours_offload,fsdp2_offload,ours_no_offload,gpu_adamw,parity")
    args = ap.parse_args()
    want = set(args.rows.split(","))
    if args.dry:
        device, cfg, shape, nbytes = torch.device("cpu"), TINY, (2, 32), 16 * 2**20
        fake.offload_on_cpu()     # our offload path on CPU (recording streams/events)
    else:
        if not torch.cuda.is_available():
            print("offload.py: no CUDA device (use --dry to rehearse on CPU)")
            return 1
        device, cfg, shape, nbytes = torch.device("cuda", 0), LLAMA_1B, (4, 2048), 2**30
        torch.cuda.set_device(device)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo" if args.dry else "cpu:gloo,cuda:nccl",
                            store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    print(f"offload.py: torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, "
          f"load {open('/proc/loadavg').read().strip()}", flush=True)
    failed = []

    def attempt(name, fn):
        if name not in want:
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one row's failure is reported, the others still run
            emit(name, False, error=f"{type(e).__name__}: {e}"[:500], s=round(time.perf_counter() - t0, 1))
            failed.append(name)

    attempt("bandwidth", lambda: bandwidth(device, nbytes))

    def run_ours(offloaded):
        row, model, opt = ours(cfg, shape, device, args.steps, offloaded)
        emit("ours_offload" if offloaded else "ours_no_offload", True, **row)
    attempt("ours_offload", lambda: run_ours(True))
    attempt("fsdp2_offload", lambda: emit("fsdp2_offload", True, **fsdp2(cfg, shape, device, args.steps)))
    attempt("ours_no_offload", lambda: run_ours(False))
    attempt("gpu_adamw", lambda: gpu_adamw(cfg, device))
    attempt("parity", lambda: parity(device))
    dist.destroy_process_group()
    bad = failed + [r["check"] for r in ROWS if not r["ok"] and r["check"] not in failed]
    print("offload.py: " + ("all rows passed" if not bad else f"FAILED: {', '.join(bad)}"), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
