"""fp.plan's link-aware prediction held against the two-node benchmark's results.

    .venv/bin/python benchmarks/two_nodes/predict.py benchmarks/two_nodes/results_small.jsonl [CALIBRATIONS.jsonl]

CALIBRATIONS.jsonl: the uncapped rows of a later run whose calibrations replace the results' own (e.g. after the
calibration gained a measurement).

Per row: the planned node egress (``WorldPlan.link_bytes_per_node``) against the link's counter, and the step
time three ways: the planner's own with assumed CPU throughputs; the planner's own with the calibration
measured on the testbed (``fp.planner.calibrate``, side by side on every rank at the start of the uncapped run:
what a user gets from ``fp.plan(..., calibration=...)``); and with compute taken from the same configuration's
uncapped run (the CPU link model ``compute + link − hidden · min(compute, link)`` alone). Error columns: the
calibrated planner's and the link model's, against the measured step.
Link rates: tbf's measured 96% of the label; "none" = 805 MB/s (the 64 MB gloo all-reduce, uncapped).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import fsdp_plugin as fp  # noqa: E402
from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402
from configs import CONFIGURATIONS, resolve  # noqa: E402
from fsdp_plugin.planner._links import CPU_LINK_HIDDEN  # noqa: E402

GBPS = {"200mbit": 0.2 * 0.96, "1gbit": 1.0 * 0.96, "none": 805e6 * 8 / 1e9}


def _calibrations(path: str) -> dict:
    """(preset, ranks per node) -> the calibration of an uncapped run in ``path`` (a later, separate run)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return {(r["preset"], r["per_node"]): r["calibration"] for r in rows if r.get("calibration")}


def main(path: str, calibrations: str = "") -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    override = _calibrations(calibrations) if calibrations else {}
    measured = {(r["preset"], r["per_node"], r["rate"], r["config"]): r for r in rows}
    print("| preset | nodes×ranks | link | config | link MB/node planned / measured | step s measured | "
          "planned (assumed CPU) | planned (calibrated) | error | planned (measured compute) | error |")
    print("|" + "---|" * 11)
    for (preset, k, rate, name), r in measured.items():
        cfg = GPTConfig(**PRESETS[preset])
        b = r["batch_per_rank"]
        spec = r.get("spec") or CONFIGURATIONS.get(name)          # --extra rows carry their own
        if spec is None:
            print(f"| {preset} | 2×{k} | {rate} | {name} | (no spec in the file: rerun with this worker) |")
            continue
        kw = resolve(spec, k)
        plan = fp.plan(lambda: GPT(cfg), world_size=2 * k, auto_wrap_policy={Block}, nodes=2, link_gbps=GBPS[rate],
                       inputs=lambda: (torch.zeros(b, cfg.seq_len, dtype=torch.long),
                                       torch.zeros(b, cfg.seq_len, dtype=torch.long)), **kw)
        w = plan.worlds[2 * k]
        base = measured.get((preset, k, "none", name))
        cal = override.get((preset, k)) or (base or {}).get("calibration")
        calibrated = float("nan")
        if cal:
            calibrated = fp.plan(lambda: GPT(cfg), world_size=2 * k, auto_wrap_policy={Block}, nodes=2,
                                 link_gbps=GBPS[rate], calibration=cal,
                                 inputs=lambda: (torch.zeros(b, cfg.seq_len, dtype=torch.long),
                                                 torch.zeros(b, cfg.seq_len, dtype=torch.long)),
                                 **kw).worlds[2 * k].step_s
        step = statistics.median(x["step_s"] for x in r["rounds"])
        link = statistics.median(sum(x["link_tx_per_node"]) / len(x["link_tx_per_node"]) for x in r["rounds"])
        compute = statistics.median(x["step_s"] for x in base["rounds"]) if base else None
        hidden = 1.0 if rate == "none" else CPU_LINK_HIDDEN     # uncapped: the compute column is that run itself
        pred = compute + w.link_s - hidden * min(compute, w.link_s) if compute else float("nan")
        print(f"| {preset} | 2×{k} | {rate} | {name} | {w.link_bytes_per_node / 1e6:.1f} / {link / 1e6:.1f} | "
              f"{step:.2f} | {w.step_s:.2f} | {calibrated:.2f} | {100 * (calibrated - step) / step:+.0f}% | "
              f"{pred:.2f} | {100 * (pred - step) / step:+.0f}% |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
