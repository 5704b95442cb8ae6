"""Checkpoint throughput: fsdp_plugin sharded safetensors vs torch.distributed.checkpoint (DCP).

    .venv/bin/python benchmarks/bench_checkpoint.py [--gb 1.0] [--reps 5] [--dir /tmp/bench_ckpt]

One run measures, interleaved per repetition (the order alternates), on the same sharded model
(``nn.Linear`` units, fp32, built on meta with ``param_init_fn="skip"`` and filled with random values):

* raw disk: 2 processes each writing their half with ``write`` + ``fsync``, then reading it back cold;
* save at world 2 (fsync included for both: DCP's ``FileSystemWriter`` fsyncs by default);
* asynchronous save at world 2 (ours ``async_save=True``, reusing its host staging buffers after the first
  save; DCP ``async_save`` with its own gloo group, default stager: its ``cache_staged_state_dict=True``
  pins memory and so needs an accelerator in this torch):
  *blocking* = until the call returns on the slowest rank, *total* = until the checkpoint is published;
* cold load at world 2, and resharded cold load 2 -> 1.

DCP gets the very same local pieces wrapped as 1-D ``ShardedTensor`` shards (zero-copy), so both write
identical bytes. "Cold" evicts the checkpoint files from the page cache with ``POSIX_FADV_DONTNEED`` (only
our files: the machine is shared, so no global ``drop_caches``). GB/s = state bytes / wall time. Results
(median [min-max]) go to ``benchmarks/RESULTS_checkpoint.md``. Loads are checked bit-exact.
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
import torch.distributed.checkpoint as dcp
from _dist import run_ranks
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

import fsdp_plugin as fp
from fsdp_plugin._flat.layout import param_shards
from fsdp_plugin.checkpoint import load_checkpoint, save_checkpoint

D = 4096


def build(gb: float) -> nn.Module:
    n = max(1, round(gb * 1e9 / (D * D * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(D, D, bias=False) for _ in range(n)])
    return fp.shard(model, sharding_strategy="full_shard", auto_wrap_policy={nn.Linear}, param_init_fn="skip")


def dcp_state(model) -> dict:
    rank = dist.get_rank()
    out = {}
    for sh in param_shards(model):
        local = sh.param.detach().reshape(-1)
        shards = [Shard(local, ShardMetadata([sh.start], [sh.end - sh.start], f"rank:{rank}/cpu"))] \
            if sh.end > sh.start else []
        out[sh.fqn] = init_from_local_shards(shards, sh.shape.numel())
    return out


def evict(*dirs) -> None:
    """Drop these directories' files from the page cache (they are fsynced, so the pages are clean)."""
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                fd = os.open(os.path.join(root, f), os.O_RDONLY)
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def timed_into(res: dict, key: str, fn) -> None:
    """Wall seconds of ``fn`` into ``res[key]``; the busiest rank's CPU seconds (all its threads) into
    ``res["cpu_" + key]``: CPU work does not stretch with the machine's load the way wall time does."""
    c0 = time.process_time()
    res[key].append(timed(fn))
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    res.setdefault("cpu_" + key, []).append(float(cpu))


def timed_async(start, wait) -> tuple[float, float]:
    """(blocking, total) seconds of an asynchronous save, the slowest rank's each."""
    dist.barrier()
    t0 = time.perf_counter()
    handle = start()
    tb = time.perf_counter() - t0
    wait(handle)
    dist.barrier()
    t = torch.tensor([tb, time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def async_saves(model, state, ours, theirs, order, res, pg) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    for which in order:
        if dist.get_rank() == 0:
            shutil.rmtree(ours if which == 0 else theirs, ignore_errors=True)
        if which == 0:
            b, t = timed_async(lambda: save_checkpoint(ours, model, async_save=True), lambda h: h.wait())
            res["ablock_ours"].append(b)
            res["atotal_ours"].append(t)
            if dist.get_rank() == 0:
                shutil.rmtree(ours, ignore_errors=True)
            b, t = timed_async(lambda: save_checkpoint(ours, model, async_save="deferred"), lambda h: h.wait())
            res["dblock_ours"].append(b)
            res["dtotal_ours"].append(t)
        else:
            writer = FileSystemWriter(theirs)  # cache_staged_state_dict=True needs an accelerator (pin_memory)
            b, t = timed_async(lambda: dcp.async_save(state, storage_writer=writer, process_group=pg),
                               lambda f: f.result())
            res["ablock_dcp"].append(b)
            res["atotal_dcp"].append(t)


def local_bytes(model) -> int:
    return sum((sh.end - sh.start) * sh.dtype.itemsize for sh in param_shards(model))


def raw_disk(path: str, nbytes: int, rank: int) -> tuple[float, float]:
    """Seconds to write+fsync ``nbytes`` of random data per rank (all ranks at once), then read it cold."""
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    f = f"{path}/raw{rank}"

    def write():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pos = 0
        while pos < nbytes:
            pos += os.write(fd, mv[pos:pos + (64 << 20)])
        os.fsync(fd)
        os.close(fd)

    def read():
        fd = os.open(f, os.O_RDONLY)
        pos = 0
        while pos < nbytes:
            pos += os.readv(fd, [mv[pos:pos + (64 << 20)]])
        os.close(fd)

    tw = timed(write)
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    tr = timed(read)
    os.remove(f)
    return tw, tr


def world2(rank, world, base, gb, reps):
    model = build(gb)
    torch.manual_seed(rank)
    for sh in param_shards(model):
        sh.param.detach().normal_()
    ref = [sh.param.detach().clone() for sh in param_shards(model)]
    state = dcp_state(model)
    ours, theirs = f"{base}/ours", f"{base}/dcp"
    res = {k: [] for k in ("raw_write", "raw_read", "save_ours", "save_dcp", "load_ours", "load_dcp",
                           "ablock_ours", "ablock_dcp", "atotal_ours", "atotal_dcp", "dblock_ours", "dtotal_ours")}
    pg = dist.new_group(backend="gloo")
    for rep in range(reps):
        tw, tr = raw_disk(base, local_bytes(model), rank)
        res["raw_write"].append(tw)
        res["raw_read"].append(tr)
        for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
            if rank == 0:
                shutil.rmtree(ours if which == 0 else theirs, ignore_errors=True)
            if which == 0:
                timed_into(res, "save_ours", lambda: save_checkpoint(ours, model))
            else:
                timed_into(res, "save_dcp", lambda: dcp.save(state, checkpoint_id=theirs))
        async_saves(model, state, ours, theirs, (0, 1) if rep % 2 == 0 else (1, 0), res, pg)
        for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
            for sh in param_shards(model):
                sh.param.detach().zero_()
            if rank == 0:
                evict(ours, theirs)
            if which == 0:
                timed_into(res, "load_ours", lambda: load_checkpoint(ours, model))
            else:
                timed_into(res, "load_dcp", lambda: dcp.load(state, checkpoint_id=theirs))
            assert all(torch.equal(a, sh.param.detach()) for a, sh in zip(ref, param_shards(model))), which
    total = torch.tensor([local_bytes(model)])
    dist.all_reduce(total)
    sums = torch.tensor([sh.param.detach().double().sum() for sh in param_shards(model)], dtype=torch.float64)
    dist.all_reduce(sums)
    return res, int(total.item()), dict(zip((sh.fqn for sh in param_shards(model)), sums.tolist()))


def world1(rank, world, base, gb, reps, sums):
    model = build(gb)
    state = dcp_state(model)
    res = {"reshard_ours": [], "reshard_dcp": []}
    for rep in range(reps):
        for which in ((0, 1) if rep % 2 == 0 else (1, 0)):
            for sh in param_shards(model):
                sh.param.detach().zero_()
            evict(f"{base}/ours", f"{base}/dcp")
            if which == 0:
                timed_into(res, "reshard_ours", lambda: load_checkpoint(f"{base}/ours", model))
            else:
                timed_into(res, "reshard_dcp", lambda: dcp.load(state, checkpoint_id=f"{base}/dcp"))
            for sh in param_shards(model):
                got = float(sh.param.detach().double().sum())
                assert abs(got - sums[sh.fqn]) <= 1e-6 * max(1.0, abs(got)), (which, sh.fqn)
    return res


def summarize(times: list[float], nbytes: int) -> str:
    rates = sorted(nbytes / t / 1e9 for t in times)
    return f"{statistics.median(rates):.2f} [{rates[0]:.2f}–{rates[-1]:.2f}]"


def ratio(a: list[float], b: list[float]) -> str:
    r = sorted(tb / ta for ta, tb in zip(a, b))
    return f"{statistics.median(r):.2f}× [{r[0]:.2f}–{r[-1]:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="model state size in GB (fp32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench_ckpt")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS_checkpoint.md"))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    load_before = os.getloadavg()
    r2 = run_ranks(world2, 2, args.dir, args.gb, args.reps, timeout=3600)
    res, nbytes, sums = r2[0]
    res.update(run_ranks(world1, 1, args.dir, args.gb, args.reps, sums, timeout=3600)[0])
    shutil.rmtree(args.dir, ignore_errors=True)
    report = render(res, nbytes, args, load_before, os.getloadavg())
    print(report)
    with open(args.out, "w") as f:
        f.write(report)


def render(res, nbytes, args, load_before, load_after) -> str:
    rows = [("raw disk: write + fsync, 2 processes", "raw_write", None),
            ("raw disk: cold read, 2 processes", "raw_read", None),
            ("save, world 2 (fsync included)", "save_ours", "save_dcp"),
            ("async save: training blocked", "ablock_ours", "ablock_dcp"),
            ("async save: until published", "atotal_ours", "atotal_dcp"),
            ('async save "deferred" (copy on the thread): blocked', "dblock_ours", "ablock_dcp"),
            ('async save "deferred": until published', "dtotal_ours", "atotal_dcp"),
            ("load, world 2, cold", "load_ours", "load_dcp"),
            ("resharded load 2 → 1, cold", "reshard_ours", "reshard_dcp")]
    lines = [
        "# Checkpoint benchmark: fsdp_plugin vs torch.distributed.checkpoint",
        "",
        (f"Generated by `benchmarks/bench_checkpoint.py --gb {args.gb} --reps {args.reps}` on "
         f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}."),
        (f"State: {nbytes / 1e9:.3f} GB fp32 (`nn.Linear({D}, {D})` units, `full_shard`, gloo, CPU). "
         f"Load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} (shared 2-vCPU VM: "
         "expect 2–3× run-to-run drift; compare within a run only)."),
        "",
        ("GB/s = state bytes / wall time, median [min–max] over repetitions; the ratio is DCP time ÷ our "
         "time per repetition (> 1: we are faster). Cold = files evicted with `POSIX_FADV_DONTNEED`."),
        "",
        "| operation | fsdp_plugin (raw for disk rows) GB/s | DCP GB/s | speed-up vs DCP |",
        "|---|---|---|---|",
    ]
    for label, ours, theirs in rows:
        if theirs is None:
            lines.append(f"| {label} | {summarize(res[ours], nbytes)} | – | – |")
        else:
            lines.append(f"| {label} | {summarize(res[ours], nbytes)} | {summarize(res[theirs], nbytes)} | "
                         f"{ratio(res[ours], res[theirs])} |")
    lines += ["", "Async blocking time as a share of the same implementation's synchronous save (median "
              f"seconds): ours {share(res['ablock_ours'], res['save_ours'])}, ours deferred "
              f"{share(res['dblock_ours'], res['save_ours'])}, DCP "
              f"{share(res['ablock_dcp'], res['save_dcp'])}.", "",
              "CPU seconds of the busiest rank (all its threads), median [min–max]; ratio = DCP ÷ ours per "
              "repetition (less sensitive to other programs on the machine than wall time):", "",
              "| operation | fsdp_plugin CPU s | DCP CPU s | DCP ÷ ours |", "|---|---|---|---|"]
    for label, ours, theirs in (rows[2], rows[7], rows[8]):
        a, b = res["cpu_" + ours], res["cpu_" + theirs]
        lines.append(f"| {label} | {spread(a)} | {spread(b)} | {ratio(a, b)} |")
    return "\n".join(lines) + "\n"


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.3f} [{xs[0]:.3f}–{xs[-1]:.3f}]"


def share(block: list[float], sync: list[float]) -> str:
    b, s = statistics.median(block), statistics.median(sync)
    return f"{b:.3f} s / {s:.3f} s = {100 * b / s:.1f}%"


if __name__ == "__main__":
    main()
