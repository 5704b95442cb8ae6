"""Muon on a sharded model, side by side (CPU, gloo): ours + fp.optim.Muon, ours + AdamW, FSDP2 + the common
gather-per-matrix Muon (every rank ``full_tensor()``s each matrix's gradient and runs torch.optim.Muon on it).

Per variant and world size: step time (median of the timed steps), bytes this rank put on the wire per step
(``wchar`` of /proc/self/io: gloo writes to TCP sockets; max over ranks), peak heap (malloc counter preloaded,
max over ranks) and, for ours, ``fp.comm_stats`` bytes per step by kind (max over ranks). Parameter groups follow the README recipe:
the blocks' 2-D matrices to Muon, embeddings (tied head), norms and biases to AdamW.

    python benchmarks/bench_muon.py --preset small --worlds 2 4 --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VARIANTS = ("ours_muon", "ours_adamw", "fsdp2_gather_muon")


def _groups(model):
    named = list(model.named_parameters())
    mats = [p for n, p in named if n.startswith("blocks.") and n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in named if not any(p is q for q in mats)]
    return mats, rest


class GatherMuon:
    """FSDP2 users' recipe: per matrix, gather the full gradient on every rank and run stock Muon on a full
    replica of the matrix (momentum and replica on every rank, identical everywhere), then copy the rank's rows."""

    def __init__(self, params, **kw):
        import torch
        self.params = params
        self.full = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in params]
        self.opt = torch.optim.Muon(self.full, **kw)

    def step(self):
        import torch
        with torch.no_grad():
            for p, f in zip(self.params, self.full):
                f.grad = p.grad.full_tensor()     # the one gather per matrix; ``f`` stays equal on every rank
            self.opt.step()
            for p, f in zip(self.params, self.full):
                local = p.to_local()
                rows = local.shape[0]
                start = p.device_mesh.get_local_rank() * -(-f.shape[0] // p.device_mesh.size())
                local.copy_(f[start:start + rows])

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _build(variant, world, preset):
    import torch
    import fsdp_plugin as fp
    from _model import GPT, GPTConfig, PRESETS, Block
    from _worker import wrap

    model = GPT(GPTConfig(**PRESETS[preset]))
    model = wrap(model, "fsdp2" if variant.startswith("fsdp2") else "ours", world)
    mats, rest = _groups(model)
    adamw = torch.optim.AdamW(rest if variant != "ours_adamw" else list(model.parameters()), lr=3e-4)
    if variant == "ours_muon":
        return model, [fp.optim.Muon(mats, lr=0.02, adjust_lr_fn="match_rms_adamw"), adamw]
    if variant == "fsdp2_gather_muon":
        return model, [GatherMuon(mats, lr=0.02, adjust_lr_fn="match_rms_adamw"), adamw]
    return model, [adamw]


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    import fsdp_plugin as fp
    from _mem import Heap, bytes_sent
    from _model import PRESETS, PRESET_BATCH

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model, opts = _build(a.variant, world, a.preset)
    cfg, heap = PRESETS[a.preset], Heap()
    per = max(1, PRESET_BATCH[a.preset] // world)
    times, wire = [], []
    for step in range(a.steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        idx = torch.randint(0, cfg["vocab"], (per, cfg["seq_len"] + 1), generator=g)
        if step == 1:
            heap.reset_peak()
            fp.comm_stats.reset()
        dist.barrier()
        t0, b0 = time.perf_counter(), bytes_sent()
        model(idx[:, :-1], idx[:, 1:]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        if step:
            times.append(time.perf_counter() - t0)
            wire.append(bytes_sent() - b0)
    out = {"variant": a.variant, "world": world, "preset": a.preset, "step_s": statistics.median(times),
           "wire_bytes_per_step": statistics.median(wire), "peak_heap": heap.peak(),
           "comm_stats_per_step": {k: v // a.steps for k, v in fp.comm_stats.bytes.items()}}
    got = [None] * world
    dist.all_gather_object(got, out)    # benchmark-only plumbing (never a load path)
    if rank == 0:
        agg = dict(got[0], step_s=max(g["step_s"] for g in got),
                   wire_bytes_per_step=max(g["wire_bytes_per_step"] for g in got),
                   peak_heap=max(g["peak_heap"] for g in got),
                   comm_stats_per_step={k: max(g["comm_stats_per_step"].get(k, 0) for g in got)
                                        for k in {k for g in got for k in g["comm_stats_per_step"]}})
        print("RESULT " + json.dumps(agg), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.variant:
        return worker(a)
    from _mem import build_heap_tracker
    so = build_heap_tracker()
    rows = []
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    for world in a.worlds:
        for v in VARIANTS:
            env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
            if so:
                env["LD_PRELOAD"] = so
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   __file__, "--variant", v, "--preset", a.preset, "--steps", str(a.steps)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if not line:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{v} at world {world} failed")
            rows.append(json.loads(line[0][7:]))
            r = rows[-1]
            print(f"{a.preset:7} N={world} {v:18} step {r['step_s'] * 1e3:8.1f} ms  wire {r['wire_bytes_per_step'] / 2**20:8.2f} "
                  f"MiB/step  peak heap {r['peak_heap'] / 2**20:8.1f} MiB  {r['comm_stats_per_step'].get('optim_exchange', '')}",
                  flush=True)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    print(f"loadavg before {load_before} after {load_after} (2 shared cores: noisy)")
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "loadavg_before": load_before, "loadavg_after": load_after},
                                          indent=1))


if __name__ == "__main__":
    main()
