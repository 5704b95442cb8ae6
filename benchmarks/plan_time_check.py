"""Is `fp.plan`'s step time right at world 1? Calibration and measurement interleaved in one process.

    python benchmarks/plan_time_check.py gpt-small [--bf16] [--rounds 4]

One process (gloo, world 1, one thread): the planner's inputs come from one fake run (FLOPs, attention FLOPs,
other bytes, optimizer traffic, ops); then each round calibrates (`fp.plan.calibrate`, as the accuracy
benchmark's worker does) and times three training steps right after, so a load change on a shared machine
hits both sides of a round alike. Prints every round's predicted terms (matmul + attention, other kernels,
optimizer, host) against the measured step and the median error over rounds. Numbers from a loaded machine
are still noisy: record `uptime` with them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _plan_models as zoo  # noqa: E402
from _worker import warm_up_runtime  # noqa: E402
from tests._launch import free_port  # noqa: E402


def planner_inputs(name: str, bf16: bool, batch, cal) -> tuple:
    """(flops, other bytes, optimizer bytes, ops, attention flops) the planner prices at world 1."""
    import fsdp_plugin as fp
    from fsdp_plugin.planner import _world as _world

    seen, predict = {}, _world.predict

    def spy(*args, **kwargs):
        seen["args"] = args
        return predict(*args, **kwargs)
    _world.predict = spy
    try:
        fp.plan(lambda: zoo.build(name), world_size=1, auto_wrap_policy=zoo.wrap_policy(name), inputs=lambda: batch,
                mixed_precision="bf16" if bf16 else None, device="cpu", calibration=cal)
    finally:
        _world.predict = predict
    flops, other, optimizer, _, _, _, ops, attention = seen["args"]
    return flops, other, optimizer, ops, attention


def terms(inputs: tuple, cal) -> dict:
    flops, other, optimizer, ops, attention = inputs
    return {"matmul+attention": (flops - attention) / cal.flops_per_s + attention / cal.attention_flops_per_s,
            "other": other / cal.elementwise_bytes_per_s, "optimizer": optimizer / cal.optimizer_bytes_per_s,
            "host": ops * cal.op_overhead_s}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=zoo.MODELS)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    import fsdp_plugin as fp
    from fsdp_plugin.planner import calibrate

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    warm_up_runtime()
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    batch = zoo.inputs(a.model, zoo.BATCH[a.model], zoo.SEQ[a.model])
    inputs = planner_inputs(a.model, a.bf16, batch, calibrate(torch.device("cpu"), dtype, seconds=0.3))
    torch.manual_seed(0)
    model = fp.shard(zoo.build(a.model), auto_wrap_policy=zoo.wrap_policy(a.model),
                     mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16) if a.bf16 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        zoo.call(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0
    step()
    errors = []
    for r in range(a.rounds):
        t = terms(inputs, calibrate(torch.device("cpu"), dtype, seconds=0.3))
        measured = statistics.median(step() for _ in range(3))
        errors.append(sum(t.values()) / measured - 1)
        print(f"round {r}: predicted {sum(t.values()):.3f} s (" + ", ".join(f"{k} {v:.3f}" for k, v in t.items())
              + f") measured {measured:.3f} s: {100 * errors[-1]:+.0f}%  load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{a.model}{' bf16' if a.bf16 else ''}: median error {100 * statistics.median(errors):+.0f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
