"""Cost of the collective pairing check (fsdp_plugin/_comm/tagged.py on gloo, pairing.py elsewhere) on the step.

    torchrun --standalone --nproc-per-node 2 benchmarks/pairing_overhead.py --preset small [--steps 20]
    torchrun --standalone --nproc-per-node 2 benchmarks/pairing_overhead.py --strategy no_shard
    torchrun --standalone --nproc-per-node 4 benchmarks/pairing_overhead.py --strategy hybrid_shard --mesh 2 2
    ... --check strict   (the blocking announcements of before issue 30, for comparison)

Two arms alternate every step so machine load hits both alike: ``checked`` (the engine as shipped) and
``unchecked`` (``RootState.gate`` returning no pairing, ``RootState.agree_next`` a no-op: collectives under
plain per-group tags). Rank 0 prints, per arm, the median step time (slowest rank: forward + backward + AdamW +
zero_grad) and the median process CPU seconds per step (all threads, busiest rank), their ratios with a 90%
bootstrap interval over steps, and the wall time spent in the pairing calls on the hot path in the checked
arm (gates, end-of-pass marks or checks, the tag bookkeeping of every tagged collective; a verdict read inside
the data's own wait is not counted). On this shared 2-core machine two *identical* arms differ by a few percent
either way, so the direct time is the number to read; the ratios bound the cost from above. Last, the
intrinsic cost of one blocking announcement (the check native transports still use): 300 back-to-back checks
in lockstep (wall and process CPU per check).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _model import GPT, PRESET_BATCH, PRESETS, Block, GPTConfig  # noqa: E402

_SPENT = {"s": 0.0, "n": 0, "depth": 0}


def _timed(check):
    def timed(self, entering, *args, **kw):
        t0 = time.perf_counter()
        _SPENT["depth"] += 1
        try:
            return check(self, entering, *args, **kw)
        finally:
            _SPENT["depth"] -= 1
            if not _SPENT["depth"]:          # agree_next announces through gate: count it once
                _SPENT["s"] += time.perf_counter() - t0
                _SPENT["n"] += 1
    return timed


def _timed_fn(fn):
    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            if not _SPENT["depth"]:
                _SPENT["s"] += time.perf_counter() - t0
    return timed


def _paired(a: list, b: list, n: int = 2000) -> tuple:
    """Median of the per-pair ratios a[i] / b[i] (adjacent steps: slow drift of the machine cancels) and its
    90% bootstrap interval, resampling pairs."""
    import random
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(0)
    rs = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return statistics.median(ratios), rs[int(0.05 * n)], rs[int(0.95 * n)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    p.add_argument("--aa", action="store_true", help="both arms checked: the noise floor of the ratios")
    p.add_argument("--strategy", default="full_shard", help="issue 30: no_shard and hybrid_shard too")
    p.add_argument("--mesh", type=int, nargs=2, metavar=("R", "S"), help="hybrid_shard's (replicate, shard)")
    p.add_argument("--check", default="auto", help="pairing_check of the checked arm (auto, strict)")
    a = p.parse_args()
    torch.set_num_threads(1)
    import fsdp_plugin as fp
    from fsdp_plugin._comm import tagged
    from fsdp_plugin._schedule.root import RootState

    checked = (_timed(RootState.gate), _timed(RootState.agree_next))
    unchecked = (lambda self, entering, *args, **kw: None,) * 2
    for name in ("issue", "finished", "before_wait", "after_wait"):     # the bookkeeping of tagged collectives
        setattr(tagged, name, _timed_fn(getattr(tagged, name)))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**PRESETS[a.preset])
    torch.manual_seed(0)
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block}, sharding_strategy=a.strategy,
                     device_mesh=tuple(a.mesh) if a.mesh else None, pairing_check=a.check)
    opt = torch.optim.AdamW(model.parameters())
    per = PRESET_BATCH[a.preset] // world
    x = torch.randint(0, cfg.vocab, (per, cfg.seq_len), generator=torch.Generator().manual_seed(rank))
    arms = ("checked", "unchecked")
    times = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    faults = {k: [] for k in arms}     # minor page faults and kernel CPU per step (busiest rank): fresh buffers
    kernel = {k: [] for k in arms}
    spent, counts = [], []
    control, waits = 0, {}
    for step in range(2 + a.steps * len(arms)):
        arm = arms[step % len(arms)]
        RootState.gate, RootState.agree_next = checked if arm == "checked" or a.aa else unchecked
        _SPENT.update(s=0.0, n=0, depth=0)
        dist.barrier()
        c_before = fp.comm_stats.calls["control"]
        fp.sync_stats.reset()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, c0 = time.perf_counter(), time.process_time()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        dt = torch.tensor([time.perf_counter() - t0, _SPENT["s"], time.process_time() - c0,
                           ru1.ru_minflt - ru0.ru_minflt, ru1.ru_stime - ru0.ru_stime], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= 2:
            times[arm].append(dt[0].item())
            cpu[arm].append(dt[2].item())
            faults[arm].append(dt[3].item())
            kernel[arm].append(dt[4].item())
            if arm == "checked":
                spent.append(dt[1].item())
                counts.append(_SPENT["n"])
                control = fp.comm_stats.calls["control"] - c_before
                waits = dict(fp.sync_stats.waits)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        mcpu = {k: statistics.median(v) for k, v in cpu.items()}
        share = statistics.median(spent) / med["checked"]
        print(f"preset {a.preset}, {a.strategy}{' ' + str(tuple(a.mesh)) if a.mesh else ''}, pairing_check="
              f"{a.check} ({model._fp_root.pairing}), world {world}, {a.steps} steps per arm, load {os.getloadavg()}"
              + (" -- A/A: both arms checked, the ratios show the machine's noise" if a.aa else ""))
        r, lo, hi = _paired(times["checked"], times["unchecked"])
        cr, clo, chi = _paired(cpu["checked"], cpu["unchecked"])
        print("median step s: " + ", ".join(f"{k} {v:.4f}" for k, v in med.items())
              + f"; checked/unchecked {med['checked'] / med['unchecked']:.4f}; paired {r:.4f} (90% {lo:.3f}-{hi:.3f})")
        print("median CPU s per step: " + ", ".join(f"{k} {v:.4f}" for k, v in mcpu.items())
              + f"; checked/unchecked {mcpu['checked'] / mcpu['unchecked']:.4f}; paired {cr:.4f} (90% {clo:.3f}-{chi:.3f})")
        print("median minor page faults per step: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in faults.items())
              + "; kernel CPU s per step: " + ", ".join(f"{k} {statistics.median(v):.4f}" for k, v in kernel.items()))
        print(f"pairing calls per step {statistics.median(counts):.0f}, time in pairing calls "
              f"{statistics.median(spent) * 1e3:.2f} ms per step = {100 * share:.2f}% of the checked step; "
              f"control collectives per step {control}; blocking waits per step {waits}")
    _lockstep(world, rank)
    dist.destroy_process_group()


def _lockstep(world: int, rank: int, n: int = 300) -> None:
    from fsdp_plugin._comm import pairing

    c = pairing.code(pairing.Entering.ALL_GATHER, 1)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        pairing.agree(c, (), None, world, 60)
    wall, cpu = (time.perf_counter() - t0) / n, (time.process_time() - c0) / n
    if rank == 0:
        print(f"one check in lockstep: wall {wall * 1e6:.0f} us, process CPU {cpu * 1e6:.0f} us")


if __name__ == "__main__":
    main()
