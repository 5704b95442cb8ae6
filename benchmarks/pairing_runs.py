"""The pairing check's cost as a user sees it: whole training runs with ``pairing_check="auto"`` against
``pairing_check="off"``, alternated (ABBA) so the machine's drift hits both alike.

    python benchmarks/pairing_runs.py --preset small --strategy no_shard --pairs 8
    python benchmarks/pairing_runs.py --preset small --strategy hybrid_shard --mesh 2 2 --pairs 8

Each run is a fresh ``torchrun`` job (``--nproc-per-node`` ranks) that trains ``--warm`` steps, then times
``--steps`` steps back to back (no barrier between them, as training runs) and reports the slowest rank's wall
seconds per step and the busiest rank's process and kernel CPU seconds per step. The driver prints the median
of the per-pair ratios auto/off with a 90% bootstrap interval over pairs, and the A/A spread of the off runs
(pair i's off run against pair i+1's). `benchmarks/pairing_overhead.py` alternates the two arms step by step
inside one process instead: see RESULTS_lab_notes.md § 30e for why the two protocols differ on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _worker(a) -> None:
    sys.path.insert(0, str(HERE))
    import torch
    import torch.distributed as dist

    import fsdp_plugin as fp
    from _model import GPT, PRESET_BATCH, PRESETS, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**PRESETS[a.preset])
    torch.manual_seed(0)
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block}, sharding_strategy=a.strategy,
                     device_mesh=tuple(a.mesh) if a.mesh else None, pairing_check=a.check)
    opt = torch.optim.AdamW(model.parameters())
    per = max(1, PRESET_BATCH[a.preset] // world)
    x = torch.randint(0, cfg.vocab, (per, cfg.seq_len), generator=torch.Generator().manual_seed(rank))

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    for _ in range(a.warm):
        step()
    dist.barrier()
    fp.sync_stats.reset()
    r0, t0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        step()
    cpu, r1 = time.process_time() - c0, resource.getrusage(resource.RUSAGE_SELF)
    waits = {k: v / a.steps for k, v in fp.sync_stats.waits.items()}
    dist.barrier()
    v = torch.tensor([time.perf_counter() - t0, cpu, r1.ru_stime - r0.ru_stime], dtype=torch.float64) / a.steps
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({"check": a.check, "step_s": v[0].item(), "cpu_s": v[1].item(),
                                      "kernel_s": v[2].item(), "waits": waits, "load": os.getloadavg()}),
              flush=True)
    fp.shutdown()


def _run(a, check: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(Path(__file__).resolve()), "--worker", "--check", check, "--preset", a.preset,
           "--strategy", a.strategy, "--steps", str(a.steps), "--warm", str(a.warm)]
    cmd += ["--mesh", *map(str, a.mesh)] if a.mesh else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[0][len("RESULT "):])


def _interval(ratios: list, n: int = 2000) -> tuple:
    rng = random.Random(0)
    rs = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return statistics.median(ratios), rs[int(0.05 * n)], rs[int(0.95 * n)]


def _driver(a) -> None:
    pairs = []
    for i in range(a.pairs):
        order = ("auto", "off") if i % 2 == 0 else ("off", "auto")     # ABBA: linear drift cancels
        got = {c: _run(a, c) for c in order}
        pairs.append(got)
        print(f"pair {i}: " + ", ".join(f"{c} {got[c]['step_s']:.4f} s (cpu {got[c]['cpu_s']:.4f}, kernel "
                                        f"{got[c]['kernel_s']:.4f}, load {got[c]['load'][0]:.1f})" for c in order),
              flush=True)
    print(f"preset {a.preset}, {a.strategy}{' ' + str(tuple(a.mesh)) if a.mesh else ''}, world {a.nproc}, "
          f"{a.pairs} pairs of runs, {a.steps} timed steps per run")
    for key in ("step_s", "cpu_s", "kernel_s"):
        r, lo, hi = _interval([p["auto"][key] / p["off"][key] for p in pairs])
        med = {c: statistics.median(p[c][key] for p in pairs) for c in ("auto", "off")}
        print(f"{key}: median auto {med['auto']:.4f}, off {med['off']:.4f}; paired auto/off {r:.4f} "
              f"(90% {lo:.3f}-{hi:.3f})")
    if len(pairs) > 2:
        r, lo, hi = _interval([p["off"]["step_s"] / q["off"]["step_s"] for p, q in zip(pairs, pairs[1:])])
        print(f"A/A (off run against the next pair's off run): {r:.4f} (90% {lo:.3f}-{hi:.3f})")
    print(f"blocking waits per step: auto {pairs[-1]['auto']['waits']}, off {pairs[-1]['off']['waits']}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--strategy", default="no_shard")
    p.add_argument("--mesh", type=int, nargs=2, metavar=("R", "S"), help="hybrid_shard's (replicate, shard)")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: 2, or R*S with --mesh)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warm", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--check", default="auto", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return _worker(a)
    a.nproc = a.nproc or (a.mesh[0] * a.mesh[1] if a.mesh else 2)
    _driver(a)


if __name__ == "__main__":
    main()
