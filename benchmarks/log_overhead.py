"""Cost of observability on the training step: INFO logging vs quiet, and the profiler-label wrappers vs the
bare handle methods (no profiler running). Alternates A/B every step so machine load hits both alike.

    python benchmarks/log_overhead.py [--preset small] [--steps 40] [--world 2]

Rank 0 prints the median step time of each arm and the ratios.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _model import GPT, PRESETS, Block, GPTConfig  # noqa: E402

_METHODS = ("unshard", "wait_unshard", "reshard", "start_reduce", "finish_reduce")


def set_arm(arm: str, handler) -> None:
    from fsdp_plugin._flat.flat_param import FlatParamHandle

    log = logging.getLogger("fsdp_plugin")
    log.setLevel(logging.INFO if arm == "info" else logging.WARNING)
    if handler not in log.handlers:
        log.addHandler(handler)
    for name in _METHODS:   # "bare": the undecorated methods; every other arm: the labelled ones
        fn = FlatParamHandle.__dict__[name]
        base = getattr(fn, "__wrapped__", fn)
        setattr(FlatParamHandle, name, base if arm == "bare" else _LABELLED[name])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    torch.set_num_threads(1)
    import fsdp_plugin as fp
    from fsdp_plugin._flat.flat_param import FlatParamHandle

    global _LABELLED
    _LABELLED = {n: FlatParamHandle.__dict__[n] for n in _METHODS}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(**PRESETS[a.preset])
    handler = logging.StreamHandler(open(os.devnull, "w"))
    model = fp.shard(GPT(cfg), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, cfg.vocab, (4, cfg.seq_len))
    arms = ("quiet", "info", "bare")
    times = {k: [] for k in arms}
    for step in range(3 + a.steps * len(arms)):
        arm = arms[step % len(arms)]
        set_arm(arm, handler)
        dist.barrier()
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= 3:
            times[arm].append(dt.item())
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"load {os.getloadavg()}; median step s: " + ", ".join(f"{k} {v:.4f}" for k, v in med.items()))
        print(f"info/quiet {med['info'] / med['quiet']:.4f}; labelled/bare {med['quiet'] / med['bare']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
