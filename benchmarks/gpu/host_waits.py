"""Issue 48 on a GPU: does the host run ahead of the device, and how does a step compare with torch FSDP2?

    python benchmarks/gpu/host_waits.py          # CUDA: Llama-3.2-1B shape (examples/llama-1b), bf16 compute
    python benchmarks/gpu/host_waits.py --dry    # CPU, a 2-layer Llama: rehearses every row

Rows (one ``GPU_CHECK_JSON {...}`` each), for ours at world 1 (a real process group of one: no collective) and
under torch's fake process group at world 8 (full_shard: every unit's all-gather and reduce-scatter issued on the
side streams, the deadline monitor watching — the branch NCCL takes, with real kernels and fake transfers), and
for FSDP2 (``fully_shard``, same model, same casts, same world):

- ``host_ms``: host time from the step's first line to ``optimizer.step()`` returning, no synchronization inside;
  ``device_ms``: wall time until the device is done (a ``synchronize`` after); ``run_ahead_ms`` = the difference:
  > 0 means the host queued the step and went on while the GPU computed;
- ``timed_waits`` / ``host_polls`` per step (``fp.sync_stats``: expected 0 for ours) and ``value_reads``: the
  engine's ``item/tolist/cpu`` calls on device tensors per step (expected 0);
- ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the measured steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, MEASURED = 6, 3


def llama(dry: bool, device=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = json.load(open(os.path.join(ROOT, "examples", "llama-1b", "config.json")))
    if dry:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    with torch.device(device or "cpu"):       # on the GPU: a 1.24 B random init takes seconds, not a minute
        return LlamaForCausalLM(config), config


class DeviceReads:
    """The engine's value reads of device tensors (each a host sync on a GPU), while active."""

    def __init__(self):
        self.count, self._saved = 0, {}

    def __enter__(self):
        for name in ("item", "tolist", "cpu"):
            fn = getattr(torch.Tensor, name)
            self._saved[name] = fn

            def counted(t, *a, _fn=fn, **k):
                if t.device.type != "cpu" and sys._getframe(1).f_globals.get("__name__", "").startswith("fsdp_plugin"):
                    self.count += 1
                return _fn(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


def build(engine: str, device, dry: bool):
    import fsdp_plugin as fp
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model, config = llama(dry, device)
    bf16 = torch.bfloat16
    if engine == "ours":
        mp = fp.MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32)
        model = fp.shard(model, auto_wrap_policy={LlamaDecoderLayer}, mixed_precision=mp, device=device)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # the baseline, never the engine
        model.to(device)
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    return model, config


def measure(engine: str, world: int, device, dry: bool) -> dict:
    import fsdp_plugin as fp
    model, config = build(engine, device, dry)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    batch, seq = (1, 32) if dry else (4, 2048)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
    cuda = device.type == "cuda"
    host, wall, timed, polls, reads = [], [], [], [], []
    for s in range(STEPS):
        if s == STEPS - MEASURED and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        fp.sync_stats.reset()
        t0 = time.perf_counter()
        with DeviceReads() as r:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        if s >= STEPS - MEASURED:
            host.append(t1 - t0)
            wall.append(t2 - t0)
            timed.append(sum(fp.sync_stats.timed.values()))
            polls.append(sum(fp.sync_stats.host.values()))
            reads.append(r.count)
    h, w = statistics.median(host) * 1e3, statistics.median(wall) * 1e3
    del model, opt
    return {"check": f"host_waits_{engine}_w{world}", "engine": engine, "world": world,
            "host_ms": round(h, 2), "device_ms": round(w, 2), "run_ahead_ms": round(w - h, 2),
            "timed_waits": max(timed), "host_polls": max(polls), "value_reads": max(reads),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    device = torch.device("cpu") if args.dry else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows, ok = [], True
    for world in (1, 8):
        if world == 1:
            from torch.distributed import FileStore
            path = f"/tmp/host_waits_store_{os.getpid()}"
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    store=FileStore(path, 1), rank=0, world_size=1)
        else:
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        for engine in ("ours", "fsdp2"):
            try:
                row = measure(engine, world, device, args.dry)
            except Exception as e:  # noqa: BLE001 - one row's failure is a row, the others still run
                row = {"check": f"host_waits_{engine}_w{world}", "error": f"{type(e).__name__}: {e}"[:400]}
                ok = ok and engine != "ours"      # FSDP2 failing under the fake group is its row, not a failure
            rows.append(row)
            print("GPU_CHECK_JSON " + json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        import fsdp_plugin as fp
        fp.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    ours = [r for r in rows if r.get("engine") == "ours"]
    ok = ok and all(r["timed_waits"] == 0 and r["host_polls"] == 0 and r["value_reads"] == 0 for r in ours)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
