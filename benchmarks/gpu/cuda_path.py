"""Issue 53's device checks: the CUDA-only code (side streams, the deadline monitor's event handles, quantized
works) on one GPU, where the review found its defects.

    python benchmarks/gpu/cuda_path.py [--dry]    # --dry: the same rows on CPU (gloo), no sanitizer

Rows (one ``GPU_CHECK_JSON {...}`` each):

1. ``sanitizer``: bf16 compute / fp32 reduce (the default GPU recipe, whose gradient cast read a compute-stream
   block on the reduce stream) at world 2 on ONE GPU over gloo with CUDA tensors (two processes share the
   device: NCCL refuses that, gloo does not), the engine's side streams on, under ``TORCH_CUDA_SANITIZER=1``
   (torch's CUDA stream sanitizer: an unsynchronized cross-stream access raises). ``ok`` = no race reported.
2. ``gloo_cuda_parity``: the same world 2 on one GPU in fp32, every step's loss and the final parameters against
   one process on the global batch (max differences).
3. ``quantized_nccl``: ``fp.Quantization(weights="int8", gradients="int8")`` at world 1 on NCCL: trains (before
   issue 53 every NCCL run with quantization aborted at its first unit collective), with the monitor's count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
import fsdp_plugin as fp  # noqa: E402
from _parity import single_process  # noqa: E402
from models import GPT, Block, gpt_batch  # noqa: E402

STEPS = 4


def _train(rank, world, device, **cfg):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, device=device, **cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for s in range(STEPS):
        x, y = gpt_batch(s, rank)
        loss = model(x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().float().cpu()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, {k: v.cpu() for k, v in fp.full_state_dict(model).items()}


def _gloo_worker(rank, world, store_path, out_path, dry, mode):
    device = torch.device("cpu") if dry else torch.device("cuda", 0)   # both ranks on the one GPU
    if not dry:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    cfg = {"mixed_precision": fp.MixedPrecision(param_dtype=torch.bfloat16)} if mode == "bf16" else {}
    losses, state = _train(rank, world, device, **cfg)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "state": {k: v.float().flatten().tolist() for k, v in state.items()}}, f)
    fp.shutdown()


def _spawn_gloo(dry: bool, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_gloo_worker, args=(2, os.path.join(tmp, "store"), out, dry, mode), nprocs=2)
        return json.load(open(out))


def sanitizer_row(dry: bool) -> dict:
    """Row 1, in a child process: the sanitizer must be on before torch initializes CUDA."""
    if dry:
        got = _spawn_gloo(True, "bf16")
        return {"check": "sanitizer", "world": 2, "ok": all(x == x for x in got["losses"]), "sanitizer": False}
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--sanitized-child"], env=env,
                       capture_output=True, text=True, timeout=240)
    text = p.stdout + p.stderr
    race = "CSAN" in text or "data race" in text.lower()
    return {"check": "sanitizer", "world": 2, "ok": p.returncode == 0 and not race, "sanitizer": True,
            "tail": text.splitlines()[-6:] if p.returncode or race else []}


def parity_row(dry: bool) -> dict:
    got = _spawn_gloo(dry, "fp32")
    want_losses, want_state = single_process(2, "sgd", steps=STEPS)
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], want_losses))
    param_diff = max(max(abs(a - b) for a, b in zip(got["state"][k], want_state[k].flatten().tolist()))
                     for k in want_state)
    return {"check": "gloo_cuda_parity", "world": 2, "max_loss_diff": loss_diff, "max_param_diff": param_diff,
            "ok": loss_diff <= 1e-5 and param_diff <= 1e-5}


def quantized_row(dry: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        backend, device = ("gloo", torch.device("cpu")) if dry else ("nccl", torch.device("cuda", 0))
        if not dry:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0, world_size=1)
        from fsdp_plugin._comm import collectives as comm
        try:
            losses, _ = _train(0, 1, device, quantization=fp.Quantization(weights="int8", gradients="int8"))
            ok, err = all(x == x for x in losses), None
        except Exception as e:  # noqa: BLE001 - the row reports it
            ok, err = False, str(e).splitlines()[0][:200]
        row = {"check": "quantized_nccl", "backend": backend, "ok": ok, "watched": comm.MONITOR.watched, "error": err}
        fp.shutdown()
    return row


def main() -> int:
    dry = "--dry" in sys.argv
    if "--sanitized-child" in sys.argv:
        _spawn_gloo(False, "bf16")
        return 0
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (or --dry)")
        return 0
    ok = True
    for make in (sanitizer_row, parity_row, quantized_row):
        row = make(dry)
        ok &= bool(row.get("ok"))
        print("GPU_CHECK_JSON " + json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
