"""What a real engine step runs against what the planner counts (load-independent: op counts and bytes).

    .venv/bin/python benchmarks/two_nodes/audit.py --preset small --per-node 1 --configs full_shard,hybrid_shard
    .venv/bin/python benchmarks/two_nodes/audit.py ... --timed      # also seconds per class (under measure.sh)

Forks 2 × ``per_node`` gloo ranks (tests/_dist.py's harness, LOCAL_WORLD_SIZE = per_node as on the testbed),
trains one warm-up step of the benchmark GPT per configuration, then one step inside a dispatch mode that prices
every aten op with the fake run's own rule (`fsdp_plugin.planner._fake_run.op_cost`) and files it under the
innermost Python frame that is the model's (benchmarks/_model.py; autograd's backward of it: "backward"), the
optimizer's (torch/optim) or the engine's (fsdp_plugin/, by module, function and op); gloo's c10d send/recv ops
apart ("comm"), and the quantization's quantize/dequantize kernels apart ("quantize": the calibration prices
those per element). RESULTS_lab_notes.md § 35d holds its table.
Rank 0's counts are printed beside the planner's for the same configuration (``fp.plan(..., nodes=2)``:
the fake run's FLOPs/bytes/ops, the replay's engine bytes and quantized elements, the optimizer's traffic and
ops). ``--timed`` adds the seconds each class spent inside its ops (the mode's own cost excluded).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(ROOT / "tests")]
import fsdp_plugin as fp  # noqa: E402
from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402
from configs import CONFIGURATIONS, preset_layer, resolve  # noqa: E402
from fsdp_plugin.planner._fake_run import op_cost  # noqa: E402

_PKG = str(ROOT / "fsdp_plugin") + "/"
_QUANTIZE_KERNELS = ("quantize", "dequantize", "_stochastic_biased", "_scales", "_pack4", "_unpack4")
_MODEL = str(HERE.parent / "_model.py")


def _where(frame) -> str:
    """The innermost frame that is the model's, the optimizer's or the engine's."""
    while frame is not None:
        f = frame.f_code.co_filename
        if f == _MODEL:
            return "model"
        if "/torch/optim/" in f:
            return "optimizer"
        if f.startswith(_PKG):
            return "engine:" + f[len(_PKG):-3] + "." + frame.f_code.co_name
        if f == __file__:
            return "backward"          # autograd's kernels of the model (called from loss.backward())
        frame = frame.f_back
    return "other"


class Audit(TorchDispatchMode):
    def __init__(self, timed: bool):
        super().__init__()
        self.timed = timed
        self.rows = defaultdict(lambda: defaultdict(float))    # where -> {ops, flop, attention, bytes, s}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter() if self.timed else 0.0
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0 if self.timed else 0.0
        kind, amount = op_cost(func, args, kwargs, out)
        if kind == "meta":
            return out
        where = _where(sys._getframe(1))
        if func.namespace == "c10d":       # gloo's send/recv/allreduce: the transfer, not a kernel
            where = "comm:" + func._overloadpacket.__name__
        elif where.startswith("engine:"):
            where += " " + func._overloadpacket.__name__
        row = self.rows[where]
        row["ops"] += 1
        row["s"] += dt
        row["s_" + kind] += dt
        if kind != "view":
            row[kind] += amount
        return out


def batch(cfg: GPTConfig, per_rank: int, rank: int):
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, cfg.vocab, (per_rank, cfg.seq_len + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _rank(rank, world, preset, names, per_node, per_rank, timed):
    cfg = GPTConfig(**PRESETS[preset])
    layer = preset_layer(cfg, per_rank)      # the preset's own shapes (§ 35d)
    cal = fp.planner.calibrate(torch.device("cpu"), seconds=0.3, layer=layer).to_dict() if timed else None
    out = {"calibration": cal}
    for name in names:
        model = fp.shard(GPT(cfg), auto_wrap_policy={Block}, **resolve(CONFIGURATIONS[name], per_node))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        walls = []
        for step in range(5):                 # 2 warm-up, 2 plain (wall time), then the audited one
            mode = Audit(timed)
            x, y = batch(cfg, per_rank, rank)
            t0 = time.perf_counter()
            with mode if step == 4 else _Null():
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            walls.append(time.perf_counter() - t0)
        out[name] = {k: dict(v) for k, v in mode.rows.items()}
        out[name]["wall"] = {"s": min(walls[2:4]), "audited_s": walls[4]}
        del model, opt
    fp.shutdown()
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def planned(preset: str, name: str, per_node: int, per_rank: int) -> dict:
    """The planner's counts for the configuration (the numbers `_time.predict` receives)."""
    from fsdp_plugin.planner import _world
    seen = {}
    real_predict, real_replay = _world.predict, _world.replay

    def predict(flops, other_bytes, optimizer_bytes, wire_bytes, calls, cal, ops=0, attention_flops=0,
                quantization_s=0.0):
        seen.update(flops=flops, attention=attention_flops, bytes_incl_engine=other_bytes,
                     optimizer_bytes=optimizer_bytes, ops=ops, quantization_s=quantization_s)
        return real_predict(flops, other_bytes, optimizer_bytes, wire_bytes, calls, cal, ops, attention_flops,
                            quantization_s)

    def replay(*a, **k):
        res = real_replay(*a, **k)
        seen.update(engine_bytes=res.engine_bytes, quantized_elems=res.quantized_elems,
                    dequantized_elems=res.dequantized_elems)
        return res
    _world.predict, _world.replay = predict, replay
    try:
        cfg = GPTConfig(**PRESETS[preset])
        fp.plan(lambda: GPT(cfg), world_size=2 * per_node, auto_wrap_policy={Block}, nodes=2, link_gbps=1.0,
                device="cpu",
                inputs=lambda: batch(cfg, per_rank, 0), **resolve(CONFIGURATIONS[name], per_node))
    finally:
        _world.predict, _world.replay = real_predict, real_replay
    return seen


def priced(plan: dict, cal: dict) -> dict:
    """The planner's compute terms (`_time.predict`'s) in seconds, for the audit's per-class times."""
    from fsdp_plugin.planner._time import Calibration, quantization_seconds
    c = Calibration(**cal)
    return {k: round(v, 4) for k, v in dict(
        matmul=(plan["flops"] - plan["attention"]) / c.flops_per_s,
        attention=plan["attention"] / c.attention_flops_per_s,
        model_bytes=(plan["bytes_incl_engine"] - plan["engine_bytes"]) / c.elementwise_bytes_per_s,
        engine_bytes=plan["engine_bytes"] / c.elementwise_bytes_per_s,
        quantization=quantization_seconds(plan["quantized_elems"], plan["dequantized_elems"], c),
        optimizer=plan["optimizer_bytes"] / c.optimizer_bytes_per_s, host=plan["ops"] * c.op_overhead_s).items()}


def _group(where: str) -> str:
    if any(f"_comm/quantized.{k} " in where for k in _QUANTIZE_KERNELS):
        return "quantize"            # the calibration prices these per element (quantize_s/dequantize_s)
    if where.startswith(("engine:", "comm:")):
        return where.split(":")[0]
    return "model" if where in ("model", "backward") else where


def summarize(rows: dict) -> dict:
    """Totals by group: model forward+backward, optimizer, engine (all its modules)."""
    groups = defaultdict(lambda: defaultdict(float))
    for where, row in rows.items():
        if where == "wall":
            continue
        for k, v in row.items():
            groups[_group(where)][k] += v
    return {g: dict(v) for g, v in groups.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--per-node", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGURATIONS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--timed", action="store_true")
    p.add_argument("--json", help="append one JSON line per configuration here")
    a = p.parse_args()
    from _dist import run_ranks
    names = [n for n in a.configs.split(",") if n]
    world = 2 * a.per_node
    res = run_ranks(_rank, world, a.preset, names, a.per_node, a.batch, a.timed, timeout=1800,
                    env={"LOCAL_WORLD_SIZE": str(a.per_node)})[0]
    cal = res["calibration"]
    for name in names:
        plan = planned(a.preset, name, a.per_node, a.batch)
        groups = summarize(res[name])
        print(f"\n== {a.preset} 2x{a.per_node} {name}")
        print(f"planner: {json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in plan.items()})}")
        if cal:
            print("  planner's seconds with this calibration: " + json.dumps(priced(plan, cal)))
        for g, row in sorted(groups.items()):
            print(f"  {g:10s} ops {row.get('ops', 0):7.0f}  flop {row.get('flop', 0) / 1e9:8.3f} G  "
                  f"bytes {row.get('bytes', 0) / 1e6:9.1f} MB  s {row.get('s', 0):.4f}  "
                  f"(flop {row.get('s_flop', 0):.4f} attn {row.get('s_attention', 0):.4f} "
                  f"bytes {row.get('s_bytes', 0):.4f} view {row.get('s_view', 0):.4f})")
        print(f"  step wall {res[name]['wall']['s']:.4f} s (audited step {res[name]['wall']['audited_s']:.4f} s)")
        by_cost = sorted(res[name].items(), key=lambda kv: -kv[1].get("s", 0) - kv[1].get("bytes", 0) / 1e12)
        for where, row in by_cost:
            if where.startswith("engine:"):
                print(f"    {where:60s} ops {row.get('ops', 0):6.0f}  bytes {row.get('bytes', 0) / 1e6:8.1f} MB  "
                      f"s {row.get('s', 0):.4f}")
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"preset": a.preset, "per_node": a.per_node, "config": name,
                                    "batch_per_rank": a.batch, "planner": plan, "real": res[name],
                                    "groups": groups}) + "\n")


if __name__ == "__main__":
    main()
