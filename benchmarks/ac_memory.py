"""Activation checkpointing modes: measured peak heap per rank vs `fp.plan`'s prediction (CPU, gloo, fp32).

    python benchmarks/ac_memory.py                                   # gpt-small and hf-llama, world 2
    python benchmarks/ac_memory.py --only hf-llama --seq 256 --batch 4

Modes (`_plan_worker.ac_setting`): none; block = ``fp.Checkpointing(units)`` (whole block recomputed);
selective = ``fp.Checkpointing(units, selective=True)`` (matmul/attention outputs kept); every2 =
``fp.Checkpointing(units, every=2)``. Measured exactly as `plan_accuracy.py` measures (the LD_PRELOAD heap
tracker of `_mem.py`, steady-state steps of forward, backward, AdamW step, zero_grad, minus the live bytes
before the model was built; the largest rank). Predicted: `fp.plan` with the same model, units, micro-batch,
activation checkpointing and the calibration the worker measured. Memory is not sensitive to machine load;
the load is printed anyway. Writes JSON lines to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import _mem  # noqa: E402
import _plan_models as zoo  # noqa: E402
from _plan_worker import AC_MODES, _units_of, ac_setting  # noqa: E402
from tests._launch import clean_env, free_port  # noqa: E402


def measure(model: str, world: int, mode: str, batch: int, seq: int, timeout: int = 900) -> dict:
    lib = _mem.build_heap_tracker()
    env = clean_env({"LD_PRELOAD": lib or "", "PYTHONPATH": str(HERE.parent)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(HERE / "_plan_worker.py"), "--model", model, "--ac-mode", mode,
           "--batch", str(batch), "--seq", str(seq), "--steps", "3"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    for line in r.stdout.splitlines():
        if line.startswith("PLAN_JSON "):
            return json.loads(line[len("PLAN_JSON "):])
    raise RuntimeError(f"{cmd} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def predict(model: str, world: int, mode: str, batch: int, seq: int, cal: dict):
    import fsdp_plugin as fp
    from fsdp_plugin.planner import Calibration

    policy = zoo.wrap_policy(model)
    if policy is None:
        with torch.device("meta"):
            policy = _units_of(zoo.build(model))
    micro = zoo.inputs(model, batch, seq)
    return fp.plan(lambda: zoo.build(model), world_size=world, auto_wrap_policy=zoo.wrap_policy(model),
                   optimizer="adamw", inputs=lambda: micro, activation_checkpointing=ac_setting(mode, policy),
                   device="cpu", calibration=Calibration(**cal)).worlds[world]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=["gpt-small", "hf-llama"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128, help="gpt-small: at most 128")
    p.add_argument("--out", default=str(HERE / "results_ac_memory.jsonl"))
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"load at start: {open('/proc/loadavg').read().strip()}", flush=True)
    print(f"world {a.world}, micro-batch {a.batch} x {a.seq} per rank, fp32, full_shard, AdamW\n")
    print("| model | AC | predicted peak MiB | measured MiB (max rank) | error | vs none (measured) |")
    print("|---|---|---|---|---|---|")
    with open(a.out, "a") as f:
        for model in a.only:
            base = None
            for mode in AC_MODES:
                meas = measure(model, a.world, mode, a.batch, a.seq)
                got = max(meas["peak_per_rank"])
                plan = predict(model, a.world, mode, a.batch, a.seq, meas["calibration"])
                base = got if base is None else base
                row = dict(model=model, world=a.world, batch=a.batch, seq=a.seq, ac=mode, predicted_peak=plan.peak,
                           measured_peak=got, peak_err=plan.peak / got - 1, heap_tracker=meas["heap_tracker"],
                           load=open("/proc/loadavg").read().split()[0])
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"| {model} | {mode} | {plan.peak / 2**20:.1f} | {got / 2**20:.1f} | "
                      f"{100 * row['peak_err']:+.1f}% | {got / base:.2f}x |", flush=True)
    print(f"\nload at end: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
