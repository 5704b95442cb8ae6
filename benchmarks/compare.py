"""fsdp_plugin side by side with torch FSDP2, FSDP1, DDP and one process: same model, data, optimizer.

    python benchmarks/compare.py                                  # preset small, world 2, all backends
    python benchmarks/compare.py --preset medium --repeats 3 --out /tmp/medium.jsonl
    python benchmarks/compare.py --scenario big --worlds 2,4,1    # deferred init + full_shard, 0.86 B params

Scenario ``train`` (default) runs every backend one after another (CPU, gloo, one thread per rank, fp32;
``torchrun --standalone`` for the distributed ones, plain python for ``single``, which takes the whole global
batch) and prints one table. Scenario ``big`` trains a model whose replicated training state (fp32 params,
grads, AdamW moments: 16 bytes/param) does not fit twice in 24 GiB, built with ``fp.deferred_init()`` and
sharded with full_shard, at each world size in ``--worlds`` (one sequence per rank; world sizes whose shard would not fit in the
available memory are skipped), and prints the memory per rank.

Columns (train)
  step s      median over timed steps of the slowest rank's step time (fwd + bwd + AdamW + zero_grad);
              with --repeats, the median over repeats, and [min-max] of it
  best s      fastest single step seen
  /fsdp2 /ddp ratio of step s to FSDP2's / DDP's
  cpu s       median per-step CPU time of the busiest rank (all its threads): less sensitive to other load
  heap MB     peak live heap per rank during the timed steps minus the heap before the model was built (exact
              malloc accounting through an LD_PRELOAD counter: every CPU tensor is a malloc block); max over ranks
  setup MB    the same for build + wrap
  rssHWM MB   peak resident set size per rank during the timed steps (absolute: includes ~300 MB of torch)
  state MB    parameters + optimizer state held by one rank at rest
  sent MB     bytes each rank wrote to its gloo sockets per step (/proc/self/io wchar), any backend
  count MB    ours only: bytes per step per rank from fsdp_plugin's collective counters (ring formula)
  foreign     CPU cores used by other programs during the timed steps (> ~0.1: timing disturbed)
  max|dL|     max over all steps of |loss - single-process loss|
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _mem  # noqa: E402
from _model import PRESETS, GPTConfig  # noqa: E402

PY = sys.executable
ALL = ("single", "ddp", "fsdp1", "fsdp2", "ours")
MB = 2**20


def have_ours() -> bool:
    r = subprocess.run([PY, "-c", "import fsdp_plugin as fp; fp.shard"], capture_output=True)
    return r.returncode == 0


def wait_quiet(max_wait: float, threshold: float = 0.2) -> float:
    """Wait up to max_wait s until other programs use < threshold cores; returns the busy cores seen last."""
    hz, t0 = os.sysconf("SC_CLK_TCK"), time.time()
    while True:
        b0, _ = _mem.cpu_jiffies()
        time.sleep(1.0)
        busy = (_mem.cpu_jiffies()[0] - b0) / hz
        if busy < threshold or time.time() - t0 >= max_wait:
            return busy
        time.sleep(2.0)


def run_worker(backend: str, nproc: int, args: list[str], env: dict, timeout: float, log: Path) -> dict:
    script = str(HERE / "_worker.py")
    if backend == "single":
        cmd = [PY, script, "--backend", "single", *args]
    else:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
               "--backend", backend, *args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = 124
    log.write_text(f"$ {shlex.join(cmd)}\n# rc={rc} wall={time.time() - t0:.1f}s\n--- stdout\n{out}\n--- stderr\n{err}")
    rec = None
    for line in out.splitlines():
        if line.startswith("BENCH_JSON "):
            rec = json.loads(line[len("BENCH_JSON "):])
    return {"backend": backend, "rc": rc, "cmd": shlex.join(cmd), "rec": rec, "log": str(log)}


def fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None or (isinstance(v, (int, float)) and v < 0) else format(v / scale, spec)


def max_over_ranks(rec, key, sub="mem"):
    vals = [r[sub][key] if sub else r[key] for r in rec["ranks"]]
    return None if any(v is None for v in vals) else max(vals)


def train_table(results: dict[str, list[dict]]) -> str:
    single = next((r["rec"] for r in results.get("single", []) if r["rec"]), None)

    def med(backend):
        vals = [r["rec"]["step_s_median"] for r in results.get(backend, []) if r["rec"]]
        return statistics.median(vals) if vals else None

    ref = {"fsdp2": med("fsdp2"), "ddp": med("ddp")}
    head = (f"{'backend':<11}{'step s':>8} {'[min-max]':>15}{'best s':>8}{'/fsdp2':>7}{'/ddp':>6}{'tok/s':>7}"
            f"{'cpu s':>7}{'heap MB':>9}{'setup MB':>9}{'rssHWM MB':>10}{'state MB':>9}{'sent MB':>8}{'count MB':>9}"
            f"{'foreign':>8}{'loss':>8}{'max|dL|':>9}")
    lines = [head, "-" * len(head)]
    for backend, runs in results.items():
        ok = [r["rec"] for r in runs if r["rec"]]
        if not ok:
            lines.append(f"{backend:<11} FAILED (rc {[r['rc'] for r in runs]}; log {runs[-1]['log']})")
            continue
        steps = [rec["step_s_median"] for rec in ok]
        m = statistics.median(steps)
        spread = f"[{min(steps):.3f}-{max(steps):.3f}]" if len(steps) > 1 else ""
        best = min(rec["step_s_min"] for rec in ok)
        rec = ok[0]
        heap = statistics.median([max(r["mem"]["heap_peak_steps"] - r["mem"]["heap_baseline"] for r in x["ranks"])
                                  for x in ok]) if rec["heap_tracker"] else None
        setup = max(r["mem"]["heap_peak_setup"] - r["mem"]["heap_baseline"] for r in rec["ranks"]) \
            if rec["heap_tracker"] else None
        rss = statistics.median([max_over_ranks(x, "rss_peak_steps") for x in ok])
        state = max(r["mem"]["param_bytes"] + r["mem"]["optim_state_bytes"] for r in rec["ranks"])
        sent = max_over_ranks(rec, "bytes_sent_per_step", sub=None)
        counted = None
        if rec["ranks"][0].get("ours_bytes_per_step"):
            counted = max(sum(v for k, v in r["ours_bytes_per_step"].items() if k != "control")
                          for r in rec["ranks"])
        foreign = max((x["foreign_cores"] or 0.0) for x in ok)
        cpu = statistics.median([statistics.median([max(r["step_cpu_s"][i] for r in x["ranks"])
                                                    for i in range(len(x["ranks"][0]["step_cpu_s"]))]) for x in ok])
        dl = None
        if single:
            dl = max(abs(a - b) for a, b in zip(rec["losses"], single["losses"]))
        lines.append(
            f"{backend:<11}{m:>8.4f} {spread:>15}{best:>8.4f}"
            f"{fmt(m / ref['fsdp2'] if ref['fsdp2'] else None, '.2f'):>7}{fmt(m / ref['ddp'] if ref['ddp'] else None, '.2f'):>6}"
            f"{rec['tokens_per_step'] / m:>7.0f}{cpu:>7.3f}{fmt(heap, '.1f', MB):>9}{fmt(setup, '.1f', MB):>9}{fmt(rss, '.1f', MB):>10}"
            f"{state / MB:>9.1f}{fmt(sent, '.2f', MB):>8}{fmt(counted, '.2f', MB):>9}{foreign:>8.2f}"
            f"{rec['losses'][-1]:>8.4f}{fmt(dl, '.2e'):>9}")
    return "\n".join(lines)


def big_table(results: list[dict], cfg: GPTConfig) -> str:
    n = cfg.num_params()
    head = (f"{'world':>5}{'state GB/rank':>14}{'16Ψ/N GB':>10}{'setup peak GB':>14}{'step peak GB':>13}"
            f"{'rssHWM GB':>10}{'init s':>8}{'step s':>8}{'loss first->last':>20}")
    lines = [f"model: {n / 1e9:.3f} B params; replicated training state 16 B/param = {16 * n / 1e9:.1f} GB "
             f"per replica, {32 * n / 1e9:.1f} GB for two (MemTotal {_meminfo('MemTotal') / 1e9:.1f} GB)", head,
             "-" * len(head)]
    GB = 1e9
    for r in results:
        if r.get("skipped"):
            lines.append(f"{r['world']:>5}  skipped: {r['skipped']}")
            continue
        rec = r["rec"]
        if not rec:
            lines.append(f"{r['world']:>5}  FAILED (rc {r['rc']}; log {r['log']})")
            continue
        w = rec["world_size"]
        state = max(x["mem"]["param_bytes"] + x["mem"]["optim_state_bytes"] for x in rec["ranks"])
        # heap numbers are absolute here (baseline ~0.1 GB included): what the process really holds
        sp = max(x["mem"]["heap_peak_setup"] for x in rec["ranks"]) if rec["heap_tracker"] else None
        st = max(x["mem"]["heap_peak_steps"] for x in rec["ranks"]) if rec["heap_tracker"] else None
        rss = max(max(x["mem"]["rss_peak_setup"], x["mem"]["rss_peak_steps"]) for x in rec["ranks"])
        setup = max(x["setup_s"] for x in rec["ranks"])
        lines.append(f"{w:>5}{state / GB:>14.2f}{16 * n / w / GB:>10.2f}{fmt(sp, '.2f', GB):>14}{fmt(st, '.2f', GB):>13}"
                     f"{rss / GB:>10.2f}{setup:>8.1f}{fmt(rec['step_s_median'], '.1f'):>8}"
                     f"{rec['losses'][0]:>10.4f}->{rec['losses'][-1]:.4f}")
    return "\n".join(lines)


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("train", "big"), default="train")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: small (train), big (big)")
    ap.add_argument("--backends", help=f"comma list; default {','.join(ALL)} (ours when fsdp_plugin imports)")
    ap.add_argument("--nproc", type=int, default=2, help="world size of the distributed backends (train)")
    ap.add_argument("--worlds", default="2,4,1", help="world sizes for --scenario big")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (train), 1 (big)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps; default 10 (train), 3 (big)")
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--wait-quiet", type=float, default=60, help="wait up to this many s for an idle machine "
                                                                 "before each run (0: don't)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--no-heap", action="store_true", help="do not preload the malloc counter")
    ap.add_argument("--out", help="append each run's JSON to this .jsonl file")
    ap.add_argument("--logdir", help="per-run logs (default: a temp folder)")
    ap.add_argument("--table-from", metavar="JSONL", help="only print the train table of runs recorded by --out")
    a = ap.parse_args(argv)

    if a.table_from:
        results: dict[str, list] = {}
        for line in Path(a.table_from).read_text().splitlines():
            rec = json.loads(line)
            results.setdefault(rec["backend"], []).append({"rec": rec, "rc": 0, "log": ""})
        print(train_table(results))
        return 0
    big = a.scenario == "big"
    preset = a.preset or ("big" if big else "small")
    warmup = a.warmup if a.warmup is not None else (1 if big else 3)
    steps = a.steps if a.steps is not None else (3 if big else 10)
    wargs = ["--preset", preset, "--warmup", str(warmup), "--steps", str(steps)]
    if a.global_batch:
        wargs += ["--global-batch", str(a.global_batch)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    heap_so = None if a.no_heap else _mem.build_heap_tracker()
    if heap_so:
        env["LD_PRELOAD"] = (heap_so + " " + env.get("LD_PRELOAD", "")).strip()
    logdir = Path(a.logdir or tempfile.mkdtemp(prefix="fsdp_plugin_bench_"))
    logdir.mkdir(parents=True, exist_ok=True)

    import torch

    cfg = GPTConfig(**PRESETS[preset])
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# {shlex.join(['python', 'benchmarks/compare.py', *(argv if argv is not None else sys.argv[1:])])}")
    print(f"# {stamp}; torch {torch.__version__}; {os.cpu_count()} cores; preset {preset} "
          f"({cfg.num_params() / 1e6:.1f} M params, {cfg.as_dict()}); warmup {warmup}, {steps} timed steps; "
          f"heap counter {'on' if heap_so else 'off'}; logs in {logdir}", flush=True)

    def record(res):
        if a.out and res.get("rec"):
            with open(a.out, "a") as f:
                f.write(json.dumps({**res["rec"], "cmd": res["cmd"], "date": stamp}) + "\n")

    if big:
        results = []
        for w in [int(x) for x in a.worlds.split(",") if x]:
            # per rank: the training-state shard, plus (measured at world 1 and 2) ~1 GB of runtime, units and
            # activations, ~2 GB with communication buffers and the kept flat gradient shard
            need = (16 * cfg.num_params() / w * 1.1 + (2.0e9 if w > 1 else 1.0e9)) * w
            avail = _mem.mem_available()
            if need > avail:
                results.append({"world": w, "skipped": f"needs ~{need / 1e9:.1f} GB in all, "
                                                      f"{avail / 1e9:.1f} GB available"})
                print(f"world {w}: skipped ({results[-1]['skipped']})", flush=True)
                continue
            if a.wait_quiet:
                wait_quiet(a.wait_quiet)
            print(f"world {w}: running ...", flush=True)
            bargs = [*wargs, "--init", "deferred"]
            if not a.global_batch:  # one sequence per rank: activations per rank stay the same across worlds
                bargs += ["--global-batch", str(w)]
            res = run_worker("ours", w, bargs, env, a.timeout, logdir / f"big.w{w}.log")
            res["world"] = w
            record(res)
            results.append(res)
        print(big_table(results, cfg))
        return 0 if all(r.get("skipped") or r["rec"] for r in results) else 1

    backends = a.backends.split(",") if a.backends else [b for b in ALL if b != "ours" or have_ours()]
    results: dict[str, list] = {b: [] for b in backends}
    for rep in range(a.repeats):
        for b in backends:
            if a.wait_quiet:
                wait_quiet(a.wait_quiet)
            res = run_worker(b, a.nproc, wargs, env, a.timeout, logdir / f"{b}.rep{rep}.log")
            record(res)
            rec = res["rec"]
            print(f"  {b:<10} rep {rep}: " + (f"{rec['step_s_median']:.4f} s/step, foreign {rec['foreign_cores'] or 0:.2f}"
                                              if rec else f"FAILED rc={res['rc']} (log {res['log']})"), flush=True)
            results[b].append(res)
    print(train_table(results))
    return 0 if all(r["rec"] for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
