"""Where one training step's time goes, per rank, without trusting wall time (the machine may be shared).

    torchrun --standalone --nproc-per-node 2 benchmarks/profile_step.py --backend ours --preset small
    torchrun --standalone --nproc-per-node 2 benchmarks/profile_step.py --backend ddp --preset small

Same model, data and optimizer as benchmarks/_worker.py. Three passes after the warm-up, each over ``--steps``:

1. CPU clocks, no profiler: per step, the process's CPU time (all threads) and the main thread's
   (``time.thread_time``); the difference is gloo's worker threads (copies, reductions, socket I/O).
2. ``cProfile`` of the main thread (clock: ``time.thread_time``): CPU per step by file group (fsdp_plugin,
   torch's Python, C calls) and the top fsdp_plugin functions with their calls per step.
3. ``torch.profiler`` (CPU): aten op counts per step (copies, concatenations, views, collectives).

Plus fsdp_plugin's collective counters per step (ours). Rank 0 prints a JSON line ``PROFILE_JSON {...}`` with
every rank's numbers and a readable summary.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _model import GPT, PRESET_BATCH, PRESETS, GPTConfig  # noqa: E402
from _worker import get_batch, wrap  # noqa: E402

OPS = ("aten::copy_", "aten::cat", "aten::split_with_sizes", "aten::view", "aten::empty", "aten::add_",
       "aten::div_", "aten::zeros", "aten::to", "aten::_to_copy", "aten::fill_", "aten::clone",
       "aten::resize_", "aten::flatten_dense_tensors", "aten::as_strided")


def step(model, opt, x, y):
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def clocks(model, opt, batches) -> dict:
    proc, main, sys_s, faults = [], [], [], []
    for x, y in batches:
        r0, p0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.thread_time()
        step(model, opt, x, y)
        proc.append(time.process_time() - p0)
        main.append(time.thread_time() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        sys_s.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    return {"proc_cpu_s": statistics.median(proc), "main_cpu_s": statistics.median(main),
            "other_threads_cpu_s": statistics.median(p - m for p, m in zip(proc, main)),
            "system_cpu_s": statistics.median(sys_s), "minor_faults": statistics.median(faults)}


def _group(filename: str) -> str:
    if "fsdp_plugin" in filename:
        return "fsdp_plugin"
    if "/torch/" in filename:
        return "torch python"
    if filename == "~":
        return "C calls"
    return "other python"


def profile_python(model, opt, batches) -> dict:
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    for x, y in batches:
        step(model, opt, x, y)
    prof.disable()
    n = len(batches)
    st = pstats.Stats(prof)
    groups, ours = Counter(), []
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
        groups[_group(fn)] += tt / n
        if "fsdp_plugin" in fn:
            ours.append((f"{Path(fn).name}:{line}:{name}", nc / n, tt / n * 1e3, ct / n * 1e3))
    c_calls = sorted(((name, nc / n, tt / n * 1e3) for (fn, _l, name), (_cc, nc, tt, _ct, _c) in st.stats.items()
                      if fn == "~"), key=lambda r: -r[2])[:15]
    ours.sort(key=lambda r: -r[3])
    return {"self_cpu_ms_by_group": {k: v * 1e3 for k, v in groups.items()},
            "fsdp_plugin_funcs": [{"func": f, "calls": c, "self_ms": s, "cum_ms": cu} for f, c, s, cu in ours[:25]],
            "fsdp_plugin_calls_per_step": sum(r[1] for r in ours),
            "top_c_calls": [{"func": f, "calls": c, "self_ms": s} for f, c, s in c_calls]}


def profile_ops(model, opt, batches) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            step(model, opt, x, y)
    n = len(batches)
    counts, comm = {}, Counter()
    for ev in prof.key_averages():
        if ev.key in OPS:
            counts[ev.key] = {"calls": ev.count / n, "self_cpu_ms": ev.self_cpu_time_total / 1e3 / n}
        if ev.key.startswith(("gloo:", "c10d::", "record_param_comms", "nccl:")):
            comm[ev.key] += ev.count / n
    total_ops = sum(ev.count for ev in prof.key_averages() if ev.key.startswith("aten::")) / n
    return {"aten_ops_per_step": total_ops, "ops": counts, "comm_ops_per_step": dict(comm)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("ddp", "ours", "ours_zero2", "fsdp1", "fsdp2"), required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clocks-only", action="store_true", help="pass 1 only (A/B runs of CPU time)")
    a = p.parse_args(argv)
    a.global_batch = PRESET_BATCH[a.preset]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**PRESETS[a.preset])
    model = wrap(GPT(cfg, seed=a.seed), a.backend, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = [get_batch(i, a, cfg, rank, world) for i in range(a.steps)]
    for i in range(a.warmup):
        step(model, opt, *batches[i % len(batches)])
    stats = None
    if a.backend.startswith("ours"):
        import fsdp_plugin as fp
        stats = fp.comm_stats
        stats.reset()
    dist.barrier()
    rec = {"rank": rank, "clocks": clocks(model, opt, batches)}
    if stats is not None:
        rec["collectives_per_step"] = {k: v / a.steps for k, v in stats.calls.items()}
    if not a.clocks_only:
        dist.barrier()
        rec["python"] = profile_python(model, opt, batches)
        dist.barrier()
        rec["ops"] = profile_ops(model, opt, batches)
    recs = [None] * world
    dist.all_gather_object(recs, rec)
    if rank == 0:
        print("PROFILE_JSON " + json.dumps({"backend": a.backend, "preset": a.preset, "world": world,
                                            "steps": a.steps, "ranks": recs}), flush=True)
        summary(a.backend, recs)
    dist.barrier()
    dist.destroy_process_group()


def summary(backend: str, recs: list) -> None:
    r = recs[0]
    c = r["clocks"]
    print(f"\n== {backend}, rank 0 (ms per step; CPU clocks, not wall)")
    print(f"process CPU {c['proc_cpu_s'] * 1e3:.1f} = main thread {c['main_cpu_s'] * 1e3:.1f} "
          f"+ other threads {c['other_threads_cpu_s'] * 1e3:.1f};  other ranks' process CPU: "
          + ", ".join(f"{x['clocks']['proc_cpu_s'] * 1e3:.1f}" for x in recs[1:]))
    print(f"of which kernel (system) CPU {c['system_cpu_s'] * 1e3:.1f}; minor page faults {c['minor_faults']:.0f}")
    if "collectives_per_step" in r:
        print("collectives per step:", {k: round(v, 2) for k, v in r["collectives_per_step"].items()})
    if "python" not in r:
        return
    py = r["python"]
    print("main-thread self CPU by group (cProfile):", {k: round(v, 1) for k, v in py["self_cpu_ms_by_group"].items()})
    print(f"fsdp_plugin Python calls per step: {py['fsdp_plugin_calls_per_step']:.0f}")
    for f in py["fsdp_plugin_funcs"][:12]:
        print(f"  {f['func']:<55} calls {f['calls']:>6.1f}  self {f['self_ms']:6.2f}  cum {f['cum_ms']:7.2f}")
    print("top C calls (self ms):")
    for f in py["top_c_calls"][:10]:
        print(f"  {f['func'][:70]:<70} calls {f['calls']:>7.1f}  self {f['self_ms']:6.2f}")
    ops = r["ops"]
    print(f"aten ops per step: {ops['aten_ops_per_step']:.0f}; comm ops: "
          f"{ {k: round(v, 1) for k, v in ops['comm_ops_per_step'].items()} }")
    for k, v in sorted(ops["ops"].items()):
        print(f"  {k:<30} calls {v['calls']:>7.1f}  self {v['self_cpu_ms']:6.2f} ms")


if __name__ == "__main__":
    main()
