"""Every device check of the wave, one command: ``python benchmarks/gpu_check.py`` on a machine with GPUs.

Each check is a module of ``benchmarks/gpu/`` run in its own subprocess (a CUDA or NCCL failure in one does not
take the others down), in the order of ``SECTIONS``; each prints one ``GPU_CHECK_JSON {...}`` line per row, and
this driver echoes them and sums up. Budget: this wave's sections ~4 minutes on one H200, all ~9 (each section's
cap is in ``SECTIONS``).

    python benchmarks/gpu_check.py              # every section, on the GPU(s)
    python benchmarks/gpu_check.py --dry        # the same script on CPU, tiny sizes: rehearse before device time
    python benchmarks/gpu_check.py --only offload,entry_points

On the device (its image has no trl, datasets or bitsandbytes): run ``bash benchmarks/gpu/carry_wheels.sh`` here
first and name ``.whl`` in the run's ``carry``; then one command: ``python3 benchmarks/gpu_check.py``.

The device machine runs the project from its working tree with the image's python and no network, where
``integrations/`` is importable as ``fsdp_plugin.integrations`` only once installed: the driver installs the
checkout (``pip install --no-deps --no-build-isolation --target``) into a temporary folder first and puts it
first on every section's ``PYTHONPATH``, so the sections run against the wheel's layout, not the checkout's.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (module under benchmarks/gpu/, wall-clock cap in seconds on the device), this wave's first: ~4 min for those five
# (`--only parity,cuda_path,context_parallel,experts,qlora` when device time is short), ~9 min in all
SECTIONS = (
    ("parity", 60),          # fp32/bf16 parity, prefetch, offload parity, peak memory (world = min(#GPUs, 4))
    ("cuda_path", 80),       # issue 53: stream sanitizer on bf16/fp32-reduce, world 2 on one GPU (gloo), int8 on NCCL
    ("context_parallel", 45),  # issue 54: cp 2 on one GPU (gloo): fp32 parity, bf16 vs each SDPA kernel, memory
    ("experts", 60),         # issue 55: ep 2 on one GPU (gloo): parity, bytes; world-1 bf16; fp.plan at fake world 8
    ("qlora", 50),           # issue 56: 4-bit nf4 + LoRA on one GPU (gloo): fp32 parity, bf16, base bytes per rank;
                             # per-shard 4-bit quantization (fp.load_pretrained) bit-identical with the CUDA kernel
    ("host_waits", 90),      # issue 48: run-ahead, host-blocking calls per step, FSDP2 side by side, fake world 8
    ("offload", 100),        # issue 49: ours vs FSDP2 CPUOffloadPolicy, phases, page faults, pinned bandwidth
    ("entry_points", 150),   # issue 50: Lightning, accelerate launch, HF Trainer, PEFT, TRL weight sync
)


def install(target: str) -> None:
    """The checkout installed as users get it (``fsdp_plugin.integrations`` included) into ``target``, with the
    wheels ``benchmarks/gpu/carry_wheels.sh`` put in ``.whl/`` (packages the device image lacks: trl, datasets,
    bitsandbytes)."""
    base = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
            "--target", target]
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    if wheels and any(importlib.util.find_spec(m) is None for m in ("trl", "bitsandbytes")):   # the device image
        subprocess.run(base + wheels, check=True, cwd=tempfile.gettempdir())
    subprocess.run(base + [ROOT], check=True, cwd=tempfile.gettempdir())


def run_section(name: str, cap_s: float, dry: bool, pythonpath: str) -> tuple[int, list, float]:
    env = dict(os.environ, PYTHONPATH=pythonpath + os.pathsep + os.path.join(ROOT, "benchmarks", "gpu")
               + os.pathsep + os.path.join(ROOT, "tests"), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu", f"{name}.py")] + (["--dry"] if dry else [])
    t0 = time.perf_counter()
    rows: list = []
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cap_s * (10 if dry else 1),
                           cwd=tempfile.gettempdir())
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    for line in out.splitlines():
        if line.startswith("GPU_CHECK_JSON "):
            rows.append(json.loads(line[len("GPU_CHECK_JSON "):]))
    if rc != 0:
        sys.stdout.write(f"--- {name} exited {rc}; its last output:\n" + "\n".join(out.splitlines()[-40:]) + "\n")
    return rc, rows, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="run every section on CPU at tiny sizes (rehearsal)")
    ap.add_argument("--only", default="", help="comma-separated section names")
    args = ap.parse_args()
    import torch
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine, or --dry to rehearse on CPU")
        return 0
    only = {s for s in args.only.split(",") if s}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        install(site)
        print(f"gpu_check: torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, dry={args.dry}")
        for name, cap in SECTIONS:
            if only and name not in only:
                continue
            rc, rows, took = run_section(name, cap, args.dry, site)
            for r in rows:
                print("GPU_CHECK_JSON " + json.dumps(dict(r, section=name)))
            print(f"== {name}: exit {rc}, {len(rows)} rows, {took:.0f} s (cap {cap} s)")
            if rc != 0 or not rows:
                failed.append(name)
    print("gpu_check: " + ("all sections passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
