"""One measured training run for benchmarks/plan_accuracy.py (torchrun, gloo, CPU, heap tracker preloaded).

Rank 0 prints ``PLAN_JSON {...}``: per-rank peak heap bytes over the steady-state steps above the baseline
taken before the model was built, median step time (slowest rank), the calibration measured on this
process group just before training, and the engine's comm_stats bytes per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _mem  # noqa: E402
import _plan_models as zoo  # noqa: E402
from _worker import warm_up_runtime  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=zoo.MODELS, required=True)
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--ac", action="store_true")
    p.add_argument("--ac-mode", choices=AC_MODES, default=None, help="activation checkpointing variant "
                   "(--ac alone: block); see ac_setting()")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    import fsdp_plugin as fp
    from fsdp_plugin.planner import calibrate

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heap = _mem.Heap()
    warm_up_runtime()
    # The baseline comes before the calibration: the heap the CPU runtime keeps after its first kernels
    # (what the planner's CPU_RUNTIME_BYTES models) must be measured as a training process without an
    # in-process calibration would hold it, so the calibration's warm-up may not hide it in the baseline.
    base = heap.reset_peak()
    cal = calibrate(torch.device("cpu"), torch.bfloat16 if a.bf16 else torch.float32, seconds=0.3)
    torch.manual_seed(0)
    heap.reset_peak()
    model = zoo.build(a.model)
    policy = zoo.wrap_policy(a.model)
    mp = fp.MixedPrecision(param_dtype=torch.bfloat16) if a.bf16 else None
    mode = a.ac_mode or ("block" if a.ac else "none")
    model = fp.shard(model, sharding_strategy=a.strategy, auto_wrap_policy=policy, mixed_precision=mp,
                     activation_checkpointing=ac_setting(mode, policy or _units_of(model)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = zoo.inputs(a.model, a.batch or zoo.BATCH[a.model], a.seq or zoo.SEQ[a.model], seed=rank)
    peaks, times, runtime = [], [], 0
    for step in range(1 + a.steps):
        if step == 1:
            fp.comm_stats.reset()
        if step == a.steps:   # memory the process holds at a step start that is not in any tensor
            runtime = heap.live() - base - live_tensor_bytes()
        dist.barrier()
        heap.reset_peak()
        t0 = time.perf_counter()
        zoo.call(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step:
            peaks.append(heap.peak() - base)
            times.append(dt)
    rec = {"rank": rank, "peak": max(peaks), "runtime": runtime, "step_s": times,
           "comm_bytes_per_step": {k: v / a.steps for k, v in fp.comm_stats.bytes.items() if k != "control"}}
    recs = [None] * world
    dist.all_gather_object(recs, rec)
    if rank == 0:
        per_step = [max(r["step_s"][i] for r in recs) for i in range(a.steps)]
        print("PLAN_JSON " + json.dumps({"model": a.model, "world": world, "strategy": a.strategy, "ac": a.ac or mode != "none", "ac_mode": mode,
                                         "bf16": a.bf16, "heap_tracker": heap.available,
                                         "peak_per_rank": [r["peak"] for r in recs],
                                         "runtime_per_rank": [r["runtime"] for r in recs],
                                         "step_s": statistics.median(per_step), "calibration": cal.to_dict(),
                                         "comm_bytes_per_step": recs[0]["comm_bytes_per_step"]}), flush=True)
    dist.destroy_process_group()


AC_MODES = ("none", "block", "selective", "every2")


def ac_setting(mode: str, modules):
    """``ShardingConfig.activation_checkpointing`` for a benchmark mode (shared with ac_memory.py's plan)."""
    import fsdp_plugin as fp

    return {"none": None, "block": fp.Checkpointing(modules),
            "selective": fp.Checkpointing(modules, selective=True),
            "every2": fp.Checkpointing(modules, every=2)}[mode]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage Python can reach (gc), i.e. what the planner models."""
    import gc

    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _units_of(model):
    """Default wrap policy (HF _no_split_modules) as an activation-checkpointing policy."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return lambda m: type(m).__name__ in names


if __name__ == "__main__":
    main()
