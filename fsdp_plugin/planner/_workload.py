"""The calibration workload: what a transformer training step runs, timed kernel class by kernel class.

One forward+backward of a pre-norm transformer layer with a vocabulary head and cross-entropy (the op mix
of the models the planner prices: tokens x width x 4 width matmuls, attention, layer norm, GELU, log-softmax)
and one AdamW step over fp32 copies of its parameters are recorded op by op below autograd, priced with the
fake run's own rule (`_fake_run.op_cost`), then replayed in order, each op timed, and summed per class:

* matmul kernels -> FLOP/s (square matmuls overstate it: the vocabulary projection runs ~10% below a
  square 512 matmul on CPU);
* attention kernels -> FLOP/s of their own (CPU: 60-65 GFLOP/s fp32, 25-50 bf16, against 85 and 150-200 for
  the matmuls), applied to the model's attention share, which depends on its sequence length;
* the other forward/backward kernels -> bytes/s in the fake run's byte count (on CPU most of them, GELU,
  log-softmax, layer norm, are compute-bound: ~3x below a streaming ``mul_``);
* the optimizer's kernels -> bytes/s of its traffic formula (`_optim.step_traffic`).

The layer's shapes are a `LayerSizes` (`fp.plan(calibration="calibrate")`: the planned model's own), since
the rates depend on them (§ 35d: 134 GFLOP/s of matmuls at the small GPT's width 256, ~98 at the medium's 768).

Replaying in the recorded order keeps each kernel's inputs as cold or warm in the caches as in training (a
loop over one class alone runs matmuls on cache-warm operands: ~15% fast in bf16). Replay calls each op
directly, without autograd or Python modules: their host cost is ``Calibration.op_overhead_s``'s.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import _optim as _optim
from ._fake_run import op_cost
from ._layer_sizes import LayerSizes

CLASSES = ("flop", "attention", "bytes", "optimizer")


class _Recorder(TorchDispatchMode):
    """Keeps (class, op, args, kwargs, price) of every priced op, in order; views are free (no kernel)."""

    def __init__(self):
        super().__init__()
        self.phase = "train"
        self.ops = []          # (class, op, args, kwargs, price), in dispatch order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind, amount = op_cost(func, args, kwargs, out)
        if kind in ("flop", "attention", "bytes"):
            self.ops.append(("optimizer" if self.phase == "optimizer" else kind, func, args, kwargs, amount))
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
        return F.cross_entropy(F.linear(y, params["head"]).view(-1, vocab), target)
    return params, loss


def measure(device: torch.device, dtype: torch.dtype, seconds: float, sizes: LayerSizes) -> dict:
    """{"flops_per_s", "attention_flops_per_s", "elementwise_bytes_per_s", "optimizer_bytes_per_s"} of the
    workload on ``device`` at ``sizes`` (already `fitted` to memory: `calibrate` fits them once and names
    them); ~``seconds`` of replays (at least 3)."""
    params, loss = _layer(device, dtype, **dataclasses.asdict(sizes))
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
    amount = {k: sum(op[4] for op in rec.ops if op[0] == k) for k in CLASSES}
    amount["optimizer"] = _optim.step_traffic("adamw", sum(m.numel() for m in masters))
    spent = _replay_seconds(rec.ops, device, seconds)
    rate = {k: amount[k] / spent[k] if spent[k] > 0 and amount[k] > 0 else None for k in CLASSES}
    return {"flops_per_s": rate["flop"], "attention_flops_per_s": rate["attention"],
            "elementwise_bytes_per_s": rate["bytes"], "optimizer_bytes_per_s": rate["optimizer"]}


def _replay_seconds(ops: list, device, seconds: float) -> dict:
    """Median seconds per class of one in-order replay of ``ops`` (median over replays: robust to another
    process taking the core a while). CUDA: events around each op, read after one synchronize."""
    def once():
        marks = []
        for kind, func, args, kwargs, _ in ops:
            start = _now(device)
            func(*args, **kwargs)
            marks.append((kind, start, _now(device)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return _per_class((k, a.elapsed_time(b) / 1e3) for k, a, b in marks)
        return _per_class((k, b - a) for k, a, b in marks)
    with torch.no_grad():
        once()
        runs, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(runs) < 3:
            runs.append(once())
    return {k: statistics.median(r[k] for r in runs) for k in CLASSES}


def _now(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
        return ev
    return time.perf_counter()


def _per_class(spans) -> dict:
    out = dict.fromkeys(CLASSES, 0.0)
    for kind, dt in spans:
        out[kind] += dt
    return out
