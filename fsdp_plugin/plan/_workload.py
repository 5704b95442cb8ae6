"""The calibration workload: what a transformer training step runs, timed kernel class by kernel class.

One forward+backward of a pre-norm transformer layer with a vocabulary head and cross-entropy (the op mix
of the models the planner prices: tokens x width x 4 width matmuls, attention, layer norm, GELU, log-softmax)
and one AdamW step over its parameters are recorded op by op below autograd, priced with the fake run's own
rule (`_fake_run.op_cost`), then each class is replayed in a loop:

* matmul/attention kernels -> FLOP/s (square matmuls overstate it: the vocabulary projection and the
  attention kernels run ~10-35% below a square 512 matmul on CPU);
* the other forward/backward kernels -> bytes/s in the fake run's byte count (on CPU most of them, GELU,
  log-softmax, layer norm, are compute-bound: ~4x below a streaming ``mul_``);
* the optimizer's kernels -> bytes/s of its traffic formula (`_optim.step_traffic`).

Replaying calls each recorded op directly, without autograd or Python modules: their host cost is
``Calibration.op_overhead_s``'s, measured separately.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import _optim
from ._fake_run import op_cost

# Layer sizes: CPU like the small models a CPU trains (a replay round ~40 ms at 1 thread), CUDA like a 1-3 B
# model's layer (a round ~10 ms on an A100 in bf16).
SIZES = {"cpu": dict(batch=4, seq=128, width=256, heads=4, vocab=8192),
         "cuda": dict(batch=8, seq=1024, width=2048, heads=16, vocab=32768)}


class _Recorder(TorchDispatchMode):
    """Keeps (op, args, kwargs, price) of every op dispatched, by phase and class."""

    def __init__(self):
        super().__init__()
        self.phase = "train"
        self.ops = {"flop": [], "bytes": [], "optimizer": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind, amount = op_cost(func, args, kwargs, out)
        if kind in ("flop", "bytes"):
            self.ops["optimizer" if self.phase == "optimizer" else kind].append((func, args, kwargs, amount))
        return out


def _layer(device, dtype, batch: int, seq: int, width: int, heads: int, vocab: int):
    """Parameters and a loss function of one pre-norm transformer layer plus the vocabulary head."""
    def p(*shape, scale=0.02):
        return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()
    params = dict(qkv=p(3 * width, width), proj=p(width, width), fc=p(4 * width, width), out=p(width, 4 * width),
                  head=p(vocab, width), ln1=p(width, scale=1.0), ln2=p(width, scale=1.0))
    x = torch.randn(batch, seq, width, device=device).to(dtype)
    target = torch.randint(0, vocab, (batch * seq,), device=device)

    def loss():
        h = F.layer_norm(x, (width,), params["ln1"])
        q, k, v = F.linear(h, params["qkv"]).view(batch, seq, 3, heads, width // heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = x + F.linear(a.transpose(1, 2).reshape(batch, seq, width), params["proj"])
        y = y + F.linear(F.gelu(F.linear(F.layer_norm(y, (width,), params["ln2"]), params["fc"])), params["out"])
        return F.cross_entropy(F.linear(y, params["head"]).view(-1, vocab).float(), target)
    return params, loss


def measure(device: torch.device, dtype: torch.dtype, seconds: float, sync) -> dict:
    """{"flops_per_s", "elementwise_bytes_per_s", "optimizer_bytes_per_s"} of the workload on ``device``."""
    params, loss = _layer(device, dtype, **SIZES["cuda" if device.type == "cuda" else "cpu"])
    # The optimizer steps fp32 master copies, as the engine's does under mixed precision (its traffic formula
    # is per fp32 element); default foreach choice, as in training.
    masters = [torch.zeros(t.shape, device=device, requires_grad=True) for t in params.values()]
    for m in masters:
        m.grad = torch.randn(m.shape, device=device)
    opt = torch.optim.AdamW(masters, lr=1e-4)
    rec = _Recorder()
    with rec:
        loss().backward()
        rec.phase = "optimizer"
        opt.step()
    sync(device)
    amount = {k: sum(op[3] for op in ops) for k, ops in rec.ops.items()}
    amount["optimizer"] = _optim.step_traffic("adamw", sum(m.numel() for m in masters))
    per = {k: amount[k] / _replay_seconds(ops, device, seconds / 3, sync) for k, ops in rec.ops.items()}
    return {"flops_per_s": per["flop"], "elementwise_bytes_per_s": per["bytes"],
            "optimizer_bytes_per_s": per["optimizer"]}


def _replay_seconds(ops: list, device, seconds: float, sync) -> float:
    """Median seconds of one replay of ``ops`` (median: robust to another process taking the core a while)."""
    def once():
        t0 = time.perf_counter()
        for func, args, kwargs, _ in ops:
            func(*args, **kwargs)
        sync(device)
        return time.perf_counter() - t0
    with torch.no_grad():
        once()
        times, t_end = [once()], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 3:
            times.append(once())
    return statistics.median(times)
