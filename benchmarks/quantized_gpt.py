"""Quantized vs exact collectives on the demo GPT (examples/train_gpt.py's model and data): same seeds, same
batches, world 2 (gloo, forked ranks), ``--steps`` AdamW (or ``--optimizer sgd``: momentum 0.9) steps each; RESULTS_lab_notes.md § 35q.

    python benchmarks/quantized_gpt.py --steps 300 --out benchmarks/results_quantized_gpt.json \
        --plot benchmarks/quantized_gpt_loss.png

Per configuration: the per-step loss (mean over ranks), a held-out loss at the end, the unit collectives'
bytes per step from ``fp.comm_stats`` (by kind) and the median step time. The claim checked: the quantized
run's final (last-20-step mean and held-out) loss within ``--tolerance`` (1%) of the exact run's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

CONFIGS = {
    "exact": None,
    "int8 weights + gradients": {"weights": "int8", "gradients": "int8"},
    "int8 weights": {"weights": "int8"},
    "int8 weights + int4 gradients": {"weights": "int8", "gradients": "int4"},
    "int4 gradients block 64": {"gradients": "int4", "block_size": 64},
    "int4 gradients": {"gradients": "int4"},
}


def _worker(rank, world, port, args, quant, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import _text
    from train_gpt import GPT, Block
    import fsdp_plugin as fp

    train_data, val_data = _text.split(_text.load_corpus())
    _noise_source(args, rank)
    torch.manual_seed(args.seed)
    model = GPT(_text.VOCAB, args.seq, args.dim, args.layers, args.heads)
    q = fp.Quantization(**quant) if quant else None
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=args.strategy, quantization=q)
    if args.optimizer == "sgd":         # SGD with momentum: its update is linear in the gradient
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, times = [], []
    for step in range(args.steps):
        x, y = _text.get_batch(train_data, args.batch, args.seq, seed=args.seed, rank=rank, step=step)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 20)
        if step == 1:
            fp.comm_stats.reset()
        t = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        fp.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        if step == 1:
            step_bytes = dict(fp.comm_stats.bytes)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    model.eval()
    with torch.no_grad():
        val = []
        for i in range(8):
            x, y = _text.get_batch(val_data, args.batch, args.seq, seed=args.seed + 1, rank=rank, step=i)
            val.append(model(x, y).item())
    held = torch.tensor([sum(val) / len(val)])
    dist.all_reduce(held)
    if rank == 0:
        queue.put({"losses": losses, "held_out": held.item() / world, "bytes_per_step": step_bytes,
                   "median_step_s": statistics.median(times[5:])})
    fp.shutdown()


def _noise_source(args, rank: int) -> None:
    """--noise-seed shifts the stochastic rounding's seed: the spread of the final loss over rounding noise."""
    from fsdp_plugin._comm import quantized as qz
    qz._SEED_BASE += 1000 * args.noise_seed


def run(args, quant) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, quant, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return result


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        losses = r["losses"]
        smooth = [statistics.fmean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=f"{name} (final {r['final']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("demo GPT, world 2, full_shard: quantized vs exact collectives")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="full_shard")
    p.add_argument("--noise-seed", type=int, default=0, help="shift of the stochastic rounding's seed")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    results = {}
    for name in args.configs.split(","):
        r = run(args, CONFIGS[name])
        r["final"] = statistics.fmean(r["losses"][-20:])
        results[name] = r
        print(f"{name:28s} final (last-20 mean) {r['final']:.4f}  held-out {r['held_out']:.4f}  "
              f"median step {r['median_step_s'] * 1000:.0f} ms  bytes/step {r['bytes_per_step']}", flush=True)
    exact = results.get("exact")
    ok = True
    if exact is not None:
        for name, r in results.items():
            rel = abs(r["final"] - exact["final"]) / exact["final"]
            rel_held = abs(r["held_out"] - exact["held_out"]) / exact["held_out"]
            r["relative_to_exact"] = {"final": rel, "held_out": rel_held}
            ok &= rel <= args.tolerance and rel_held <= args.tolerance
            print(f"{name:28s} vs exact: final {100 * rel:.2f}%, held-out {100 * rel_held:.2f}%")
    meta = {"args": vars(args), "load": os.getloadavg(), "ok": ok}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot)
    print("within tolerance" if ok else "NOT within tolerance", "| load", os.getloadavg())
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
