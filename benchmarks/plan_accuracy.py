"""How good is `fp.plan`? Predicted vs measured peak bytes per rank and step time (CPU, gloo, fp32/bf16).

    python benchmarks/plan_accuracy.py                      # the reduced matrix (see MATRIX)
    python benchmarks/plan_accuracy.py --full               # every model x world x strategy x AC x bf16
    python benchmarks/plan_accuracy.py --only gpt-small     # one model

Measured: `_plan_worker.py` under torchrun with the exact-heap tracker (`_mem.py`, LD_PRELOAD): the largest
live malloc bytes during steady-state steps (forward, backward, AdamW step, zero_grad), minus the live bytes
before the model was built, per rank. Predicted: `fp.plan` with the same model builder, wrap policy, strategy,
per-rank micro-batch and the calibration the worker measured on its process group just before training
(`fp.plan.calibrate`). Prints a markdown table and writes JSON lines to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import _mem  # noqa: E402
import _plan_models as zoo  # noqa: E402
from tests._launch import clean_env, free_port  # noqa: E402

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


def matrix(full: bool, only):
    models = [m for m in zoo.MODELS if not only or m in only]
    out = []
    for m in models:
        for w in (1, 2, 4):
            for s in (STRATEGIES if w > 1 else ("full_shard",)):
                for ac in ((False, True) if full else (False,)):
                    for bf16 in ((False, True) if full else (False,)):
                        out.append((m, w, s, ac, bf16))
        if not full:
            out += [(m, 2, "full_shard", True, False), (m, 2, "full_shard", False, True)]
    return out


def measure(model, world, strategy, ac, bf16, timeout=900):
    lib = _mem.build_heap_tracker()
    env = clean_env({"LD_PRELOAD": lib or "", "PYTHONPATH": str(HERE.parent)})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), str(HERE / "_plan_worker.py"), "--model", model, "--strategy", strategy]
    cmd += ["--ac"] * ac + ["--bf16"] * bf16
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    for line in r.stdout.splitlines():
        if line.startswith("PLAN_JSON "):
            return json.loads(line[len("PLAN_JSON "):])
    raise RuntimeError(f"{cmd} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def predict(model, world, strategy, ac, bf16, cal):
    import fsdp_plugin as fp
    from fsdp_plugin.planner import Calibration

    batch = zoo.inputs(model, zoo.BATCH[model], zoo.SEQ[model])
    return fp.plan(lambda: zoo.build(model), world_size=world, sharding_strategy=strategy,
                   auto_wrap_policy=zoo.wrap_policy(model), optimizer="adamw", inputs=lambda: batch,
                   loss_fn=None, mixed_precision="bf16" if bf16 else None, activation_checkpointing=ac or None,
                   device="cpu", calibration=Calibration(**cal))


def repredict(path):
    """Same measurements, current planner: rewrite predicted_peak and the peak errors in place (and the step
    time, for rows that recorded the calibration their worker measured)."""
    from fsdp_plugin.planner import Calibration

    rows = [json.loads(line) for line in open(path)]
    for r in rows:
        cal = r.get("calibration") or Calibration(1e9, 1e9, 1e9).to_dict()
        wp = predict(r["model"], r["world"], r["strategy"], r["ac"], r["bf16"], cal).worlds[r["world"]]
        got, rt = r["measured_peak"], r["runtime_bytes"]
        r.update(predicted_peak=wp.peak, peak_err=wp.peak / got - 1, peak_err_model=wp.peak / (got - rt) - 1)
        if r.get("calibration"):
            r.update(predicted_step_s=wp.step_s, step_err=wp.step_s / r["measured_step_s"] - 1)
        print(f"{r['model']} {r['world']} {r['strategy']} ac={r['ac']} bf16={r['bf16']}: "
              f"{100 * r['peak_err']:+.1f}% ({100 * r['peak_err_model']:+.1f}% vs tensors)"
              + (f", step {100 * r['step_err']:+.0f}%" if r.get("calibration") else ""), flush=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true")
    p.add_argument("--only", nargs="*")
    p.add_argument("--out", default=str(HERE / "results_plan_accuracy.jsonl"))
    p.add_argument("--skip-done", action="store_true", help="skip rows already recorded in --out")
    p.add_argument("--repredict", metavar="JSONL", help="recompute the predicted peaks of recorded measurements "
                                                         "with the current planner (measurements unchanged)")
    a = p.parse_args()
    if a.repredict:
        return repredict(a.repredict)
    torch.set_num_threads(1)
    print(f"load at start: {os.getloadavg()}", flush=True)
    print("| model | world | strategy | AC | bf16 | predicted peak MiB | measured MiB (max rank) | error | "
          "runtime MiB | error w/o runtime | predicted step s | measured s | error | wire MiB pred / counted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with open(a.out, "a") as f:
        done = set()
        if a.skip_done and Path(a.out).exists():
            done = {(r["model"], r["world"], r["strategy"], r["ac"], r["bf16"])
                    for r in map(json.loads, open(a.out))}
        for m, w, s, ac, bf16 in matrix(a.full, a.only):
            if (m, w, s, ac, bf16) in done:
                continue
            t0 = time.time()
            try:
                meas = measure(m, w, s, ac, bf16)
            except RuntimeError as e:   # the training run itself failed: say so, keep going
                why = [ln for ln in str(e).splitlines() if "Error:" in ln and "RuntimeError: [" not in ln]
                print(f"| {m} | {w} | {s} | {'on' if ac else 'off'} | {'on' if bf16 else 'off'} | training run failed: "
                      f"{(why or ['?'])[0].strip()[:160]} |", flush=True)
                continue
            plan = predict(m, w, s, ac, bf16, meas["calibration"]).worlds[w]
            got = max(meas["peak_per_rank"])
            rt = meas["runtime_per_rank"][meas["peak_per_rank"].index(got)]
            wire = sum(meas["comm_bytes_per_step"].values())
            row = dict(model=m, world=w, strategy=s, ac=ac, bf16=bf16, predicted_peak=plan.peak, measured_peak=got,
                       peak_err=plan.peak / got - 1, runtime_bytes=rt, peak_err_model=plan.peak / (got - rt) - 1, predicted_step_s=plan.step_s, measured_step_s=meas["step_s"],
                       step_err=plan.step_s / meas["step_s"] - 1, predicted_wire=plan.wire_total,
                       counted_wire=wire, load=os.getloadavg()[0], wall_s=time.time() - t0,
                       calibration=meas["calibration"])
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"| {m} | {w} | {s} | {'on' if ac else 'off'} | {'on' if bf16 else 'off'} | {plan.peak / 2**20:.1f} "
                  f"| {got / 2**20:.1f} | {100 * row['peak_err']:+.1f}% | {rt / 2**20:.1f} | {100 * row['peak_err_model']:+.1f}% "
                  f"| {plan.step_s:.3f} | {meas['step_s']:.3f} "
                  f"| {100 * row['step_err']:+.0f}% | {plan.wire_total / 2**20:.2f} / {wire / 2**20:.2f} |", flush=True)
    print(f"load at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
