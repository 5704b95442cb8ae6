"""Reading a torch DCP checkpoint: our DCP reader (``fp.load_checkpoint``) vs DCP's own ``dcp.load``.

    .venv/bin/python benchmarks/bench_dcp_read.py [--mb 256] [--reps 3] [--dir /tmp/bench_dcp_read]

One source checkpoint: an FSDP2 model of ``nn.Linear`` layers (fp32) + AdamW state after one step, written by
``dcp.save`` at world 2. Then, interleaved per repetition (the order alternates), cold (the files evicted
from the page cache with ``POSIX_FADV_DONTNEED``; only our files: the machine is shared):

* ``dcp.load`` at world 2 into the same FSDP2 model (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``);
* ours at world 2 into our sharded model (``fp.load_checkpoint``: byte ranges of each rank's pieces);
* ours at world 1 (resharding 2 -> 1).

GB/s = state bytes (model + optimizer) / wall time of the slowest rank. Prints median [min-max] and the load
average; append the lines to ``benchmarks/RESULTS_checkpoint.md`` by hand (noisy on a shared machine).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
warnings.filterwarnings("ignore")

import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

import fsdp_plugin as fp

WIDTH = 1024


def _model(mb: int) -> nn.Module:
    torch.manual_seed(0)
    n = max(1, mb * (1 << 20) // (4 * WIDTH * WIDTH))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n)])


def _evict(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _step(model, opt):
    model(torch.ones(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad()


def _save(rank, world, path, mb):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model(mb)
    for lin in model:
        fully_shard(lin)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)


def _timed(fn) -> float:
    """Wall seconds of ``fn`` between two barriers (the slowest rank), on rank 0 (0.0 elsewhere)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - t0 if rank0 else 0.0


def _load_stock(rank, world, path, mb):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model(mb)
    for lin in model:
        fully_shard(lin)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)  # state exists, as after get_state_dict's own init step

    def load():
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    return _timed(load)


def _load_ours(rank, world, path, mb):
    model = fp.shard(_model(mb), auto_wrap_policy={nn.Linear}) if world > 1 else _model(mb)
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt)
    return _timed(lambda: fp.load_checkpoint(path, model, opt))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="model size in MB (fp32); optimizer state is twice that")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench_dcp_read")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    path = os.path.join(a.dir, "src")
    run_ranks(_save, 2, path, a.mb, timeout=600)
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    variants = {"dcp.load world 2": (_load_stock, 2), "ours world 2": (_load_ours, 2), "ours world 1": (_load_ours, 1)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(a.reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            fn, world = variants[name]
            _evict(path)
            times[name].append(run_ranks(fn, world, path, a.mb, timeout=600)[0])
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"DCP checkpoint {nbytes / 1e9:.3f} GB on disk (model {a.mb} MB + AdamW state), cold reads, "
          f"{a.reps} reps, loadavg {load}")
    for name, ts in times.items():
        gbs = [nbytes / t / 1e9 for t in ts]
        print(f"  {name:18s} {statistics.median(gbs):.2f} GB/s [{min(gbs):.2f}-{max(gbs):.2f}]  "
              f"median {statistics.median(ts):.2f} s")


if __name__ == "__main__":
    main()
