"""Cost of the late-rank status (fsdp_plugin/_comm/status.py) on the training step: the hot path (number,
ring record, timestamps per collective) on vs off, alternating every step so machine load hits both alike,
plus a micro-benchmark of the hot path per collective (less noisy than step times on a shared machine).

    torchrun --nproc-per-node 2 benchmarks/status_overhead.py [--preset small] [--steps 30]

Rank 0 prints the median step time of each arm, their ratio, the collectives per step and the hot path's
microseconds per collective. The status thread (one store set per INTERVAL_S) runs in both arms.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402


def hot_path_us(n: int = 20000) -> float:
    """Microseconds of issued + waiting + finished for one collective (a finished dummy work)."""
    from fsdp_plugin._comm import status

    class Done:
        fp_op = None

        def wait(self, timeout=None):
            return True

    work, t0 = Done(), time.perf_counter()
    for _ in range(n):
        op, w = status.waiting(status.issued(work, "all_gather", None, 2, 1), "all-gather of unit 'x'")
        status.finished(op)
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    import fsdp_plugin as fp
    from fsdp_plugin._comm import status

    dist.init_process_group("gloo")
    cfg = GPTConfig(**PRESETS[a.preset])
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, cfg.vocab, (4, cfg.seq_len))
    times, ops = {"on": [], "off": []}, []
    for step in range(3 + 2 * a.steps):
        arm = ("on", "off")[step % 2]
        status.ENABLED = arm == "on"
        dist.barrier()
        before = sum(fp.comm_stats.calls.values())
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        ops.append(sum(fp.comm_stats.calls.values()) - before)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= 3:
            times[arm].append(dt.item())
    status.ENABLED = True
    us = hot_path_us()
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        per_step = statistics.median(ops)
        print(f"load {os.getloadavg()}; median step s: on {med['on']:.4f}, off {med['off']:.4f}; "
              f"on/off {med['on'] / med['off']:.4f}")
        print(f"collectives per step {per_step}; hot path {us:.2f} us per collective = "
              f"{per_step * us / 1e3:.3f} ms per step = {per_step * us / 1e6 / med['off'] * 100:.4f}% of a step")
    fp.shutdown()


if __name__ == "__main__":
    main()
