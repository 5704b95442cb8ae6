"""One benchmark run of one backend (CPU, gloo, fp32). Started by benchmarks/compare.py:

    python benchmarks/_worker.py --backend single --preset small
    torchrun --standalone --nproc-per-node 2 benchmarks/_worker.py --backend ours --preset small

Backends: single | ddp | fsdp1 | fsdp2 | ours (fsdp_plugin, full_shard) | ours_zero2 (shard_grad_op) |
ours_compiled (full_shard + ``fp.compile``: inductor per block; compilation happens in the warm-up steps).
All see the same model (benchmarks/_model.py, seed 0), the same global batch (seeded random tokens from a
pool of 2 batches, cycled; rank r takes rows [r*B/W, (r+1)*B/W)) and AdamW(lr 1e-3, betas (0.9, 0.95),
weight decay 0.1, torch's default CPU implementation). Rank 0 prints one ``BENCH_JSON {...}`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _mem  # noqa: E402
from _model import GPT, PRESET_BATCH, PRESETS, Block, GPTConfig  # noqa: E402

BACKENDS = ("single", "ddp", "fsdp1", "fsdp2", "ours", "ours_zero2", "ours_compiled")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--global-batch", type=int)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--init", choices=("eager", "deferred"), default="eager",
                   help="deferred: build under fp.deferred_init() (ours only)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def get_batch(step, a, cfg, rank, world):
    g = torch.Generator().manual_seed(a.seed * 7919 + 1000 + step % 2)
    data = torch.randint(0, cfg.vocab, (a.global_batch, cfg.seq_len + 1), generator=g)
    per = a.global_batch // world
    data = data[rank * per:(rank + 1) * per]
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def wrap(model, backend, world):
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if backend == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                        auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                                        device_id=torch.device("cpu"))
    if backend == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if backend in ("ours", "ours_zero2", "ours_compiled"):
        import fsdp_plugin as fp

        strategy = "shard_grad_op" if backend == "ours_zero2" else "full_shard"
        model = fp.shard(model, fp.ShardingConfig(sharding_strategy=strategy, auto_wrap_policy={Block}))
        return fp.compile(model) if backend == "ours_compiled" else model
    return model


def local_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if hasattr(t, "to_local"):  # DTensor (FSDP2): its local shard
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def ours_comm():
    try:
        import fsdp_plugin as fp
    except ImportError:
        return None
    stats = getattr(fp, "comm_stats", None)
    return stats.snapshot() if stats is not None else None


def warm_up_runtime():
    """One tiny step so lazily allocated runtime state lands in the baseline, not in the model's numbers."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    m = GPT(GPTConfig(n_layer=1, d_model=16, n_head=2, vocab=32, seq_len=8))
    o = torch.optim.AdamW(m.parameters())
    x = torch.randint(0, 32, (2, 8))
    m(x, x).backward()
    o.step()


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = GPTConfig(**PRESETS[a.preset])
    a.global_batch = a.global_batch or PRESET_BATCH[a.preset]
    heap = _mem.Heap()
    distributed = a.backend != "single"
    if distributed:
        if "WORLD_SIZE" not in os.environ:
            sys.exit(f"backend {a.backend} needs torchrun")
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if a.global_batch % world:
        sys.exit(f"global batch {a.global_batch} is not divisible by world size {world}")
    is_ours = a.backend.startswith("ours")
    if a.init == "deferred" and not is_ours:
        sys.exit("--init deferred needs backend ours")

    warm_up_runtime()
    baseline_heap, baseline_rss = heap.reset_peak(), _mem.rss()
    _mem.reset_rss_peak()

    t0 = time.perf_counter()
    if a.init == "deferred":
        import fsdp_plugin as fp

        with fp.deferred_init():
            model = GPT(cfg, seed=a.seed)
    else:
        model = GPT(cfg, seed=a.seed)
    t_build = time.perf_counter() - t0
    model = wrap(model, a.backend, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if distributed:
        dist.barrier()
    setup_s = time.perf_counter() - t0
    mem = {"heap_baseline": baseline_heap, "rss_baseline": baseline_rss,
           "heap_peak_setup": heap.peak(), "heap_after_setup": heap.live(), "rss_peak_setup": _mem.rss_peak()}

    losses, times, cpu = [], [], []
    phase_peak = {"fwd": -1, "bwd": -1, "opt": -1}  # heap peak per phase over the timed steps
    sent0 = comm0 = region0 = None
    for step in range(a.warmup + a.steps):
        timed = step >= a.warmup
        if step == a.warmup:
            if distributed:
                dist.barrier()
            heap.reset_peak()
            _mem.reset_rss_peak()
            sent0, comm0 = _mem.bytes_sent(), ours_comm()
            region0 = (time.perf_counter(), time.process_time(), _mem.cpu_jiffies())
        x, y = get_batch(step, a, cfg, rank, world)
        heap.reset_peak()
        c0, s0 = time.process_time(), time.perf_counter()
        loss = model(x, y)
        p_fwd = heap.peak()
        heap.reset_peak()
        loss.backward()
        p_bwd = heap.peak()
        heap.reset_peak()
        opt.step()
        opt.zero_grad(set_to_none=True)
        s1, c1 = time.perf_counter(), time.process_time()
        if timed:
            for k, v in (("fwd", p_fwd), ("bwd", p_bwd), ("opt", heap.peak())):
                phase_peak[k] = max(phase_peak[k], v)
        sent_step = _mem.bytes_sent()  # the loss all-reduce below is not part of the step
        lt = loss.detach().clone()
        if distributed:
            dist.all_reduce(lt)
            lt /= world
        losses.append(lt.item())
        if timed:
            times.append(s1 - s0)
            cpu.append(c1 - c0)
            sent0 += _mem.bytes_sent() - sent_step  # discount the loss all-reduce's bytes
    wall1, cpu1, jif1 = time.perf_counter(), time.process_time(), _mem.cpu_jiffies()
    sent = _mem.bytes_sent() - sent0 if sent0 is not None and sent0 >= 0 else -1
    comm1 = ours_comm()
    hz = os.sysconf("SC_CLK_TCK")
    region = {"wall_s": wall1 - region0[0], "proc_cpu_s": cpu1 - region0[1],
              "machine_busy_s": (jif1[0] - region0[2][0]) / hz} if region0 else None
    params = list(model.parameters())
    opt_state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    mem.update({"heap_peak_steps": max(phase_peak.values()), **{f"heap_peak_{k}": v for k, v in phase_peak.items()},
                "heap_end": heap.live(), "rss_peak_steps": _mem.rss_peak(),
                "rss_end": _mem.rss(), "param_bytes": local_bytes(params),
                "optim_state_bytes": local_bytes(opt_state)})
    comm_logical = None
    if comm0 is not None and comm1 is not None and a.steps:
        comm_logical = {k: (v - comm0["bytes"].get(k, 0)) / a.steps for k, v in comm1["bytes"].items()}
    rec = {"rank": rank, "step_s": times, "step_cpu_s": cpu, "setup_s": setup_s, "build_s": t_build,
           "mem": mem, "region": region, "bytes_sent_per_step": sent / max(a.steps, 1) if sent >= 0 else None,
           "ours_bytes_per_step": comm_logical}
    recs = [None] * world
    if distributed:
        dist.all_gather_object(recs, rec)
    else:
        recs = [rec]
    if rank == 0:
        per_step = [max(r["step_s"][i] for r in recs) for i in range(len(times))]
        foreign = None
        if all(r["region"] for r in recs):
            wall = recs[0]["region"]["wall_s"]
            foreign = max(0.0, (recs[0]["region"]["machine_busy_s"] - sum(r["region"]["proc_cpu_s"] for r in recs))
                          / max(wall, 1e-9))
        out = {"backend": a.backend, "preset": a.preset, "config": cfg.as_dict(), "num_params": cfg.num_params(),
               "world_size": world, "threads_per_rank": a.threads, "global_batch": a.global_batch,
               "tokens_per_step": a.global_batch * cfg.seq_len, "warmup": a.warmup, "steps": a.steps,
               "init": a.init, "torch": torch.__version__, "heap_tracker": heap.available, "losses": losses,
               "step_s_median": statistics.median(per_step) if per_step else None,
               "step_s_min": min(per_step) if per_step else None, "foreign_cores": foreign, "ranks": recs}
        print("BENCH_JSON " + json.dumps(out), flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
