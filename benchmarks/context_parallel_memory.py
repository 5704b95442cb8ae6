"""Activation memory per rank under context parallel (issue 54): the bytes autograd saves for backward in one
forward of a Llama-shaped model at a fixed sequence length, without CP (one process) and at cp 2 and 4 (forked
gloo ranks on this CPU), for each attention mode; the largest rank is reported.

    python benchmarks/context_parallel_memory.py [--seq 4096] [--out benchmarks/results_context_parallel_memory.json]
        [--cap-mib 256]     # also: the longest power-of-two length whose peak fits the cap, without CP and at cp 2/4

"Saved" counts every tensor autograd keeps (``torch.autograd.graph.saved_tensors_hooks``) and still holds at the
end of the forward, each storage once:
the activation memory a step holds between forward and backward (without activation checkpointing), which is
what context parallel divides. "Peak" is the most bytes of tensors created in the step alive at once
(activations, transients such as scores and masks, gradients; parameters excluded), "largest" the biggest
single tensor. The all-gather mode (tiled, ``_context/blockwise.py``) keeps only local q/k/v/out per layer and
its largest transient is one tile's scores; Ulysses keeps H/C heads of the whole sequence and an S x S mask.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=65536)


class _Live(TorchDispatchMode):
    """Bytes of the tensors created inside the step that are alive, at their peak (each storage once, freed
    when its last reference goes), and the largest single tensor: transients such as attention scores and
    masks, which saved-for-backward bytes do not show."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.largest = {}, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(ptr)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                    self.now += st.nbytes()
                self.largest = max(self.largest, t.numel() * t.element_size())
        self.peak = max(self.peak, self.now)
        return out


def _saved_bytes(model, batch) -> tuple:
    """(bytes saved for backward, peak live bytes of the step, largest tensor's bytes)."""
    seen: dict = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            old = seen.get(st.data_ptr())
            if old is None or old[0].expired():     # a freed storage's address can come back: a new one
                seen[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        return t

    with _Live() as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        saved = sum(n for ref, n in seen.values() if not ref.expired())     # held from forward to backward
        loss.backward()
        del loss
    return saved, live.peak, live.largest


def _model():
    import transformers as tf
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).train()


def _batch(seq):
    ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _rank(rank, world, store, seq, method, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    import fsdp_plugin as fp
    try:
        model = fp.shard(_model(), context_parallel=world, context_parallel_attention=method)
        start = time.perf_counter()
        saved = _saved_bytes(model, _batch(seq))
        out.put((rank, saved, time.perf_counter() - start))
    except BaseException as e:     # the parent stops every rank on the first failure
        out.put((rank, None, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def measure(seq: int, cp: int, method: str) -> dict:
    if cp == 1:
        start = time.perf_counter()
        saved, peak, largest = _saved_bytes(_model(), _batch(seq))
        return {"cp": 1, "method": "none", "saved_bytes_max_rank": saved, "peak_bytes_max_rank": peak,
                "largest_tensor_bytes": largest, "step_s": round(time.perf_counter() - start, 2)}
    ctx, tmp = mp.get_context("fork"), tempfile.mkdtemp()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cp, os.path.join(tmp, "store"), seq, method, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(queue.get(timeout=300))
            if got[-1][1] is None:
                raise RuntimeError(f"rank {got[-1][0]} failed: {got[-1][2]}")
    finally:
        for p in procs:
            if p.is_alive() and len(got) < cp:
                p.kill()
            p.join()
    return {"cp": cp, "method": method, "saved_bytes_max_rank": max(g[1][0] for g in got),
            "peak_bytes_max_rank": max(g[1][1] for g in got), "largest_tensor_bytes": max(g[1][2] for g in got),
            "step_s": round(max(g[2] for g in got), 2)}


def longest(cap: float, cp: int, method: str, start: int = 1024) -> dict:
    """The longest power-of-two sequence (from ``start``, doubling) whose peak live bytes on the largest rank
    stay within ``cap``."""
    seq, best = start, None
    while True:
        row = measure(seq, cp, method)
        if row["peak_bytes_max_rank"] > cap:
            return {"cp": cp, "method": method, "longest_seq": best, "peak_MiB_at_next": round(
                row["peak_bytes_max_rank"] / 2**20, 1), "next_seq": seq}
        best, seq = seq, seq * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cap-mib", type=float, default=None)
    args = ap.parse_args()
    rows = [measure(args.seq, 1, "none")]
    for cp in (2, 4):
        for method in ("allgather", "ring", "ulysses"):
            rows.append(measure(args.seq, cp, method))
    base = rows[0]["saved_bytes_max_rank"]
    for r in rows:
        r["vs_no_cp"] = round(r["saved_bytes_max_rank"] / base, 3)
        r["saved_MiB"] = round(r["saved_bytes_max_rank"] / 2**20, 1)
        r["peak_MiB"] = round(r["peak_bytes_max_rank"] / 2**20, 1)
        r["largest_MiB"] = round(r["largest_tensor_bytes"] / 2**20, 2)
    result = {"seq": args.seq, "shape": SHAPE, "loadavg": os.getloadavg(), "rows": rows}
    if args.cap_mib:
        result["cap_MiB"] = args.cap_mib
        result["longest_fitting"] = [longest(args.cap_mib * 2**20, cp, m)
                                     for cp, m in ((1, "none"), (2, "allgather"), (2, "ring"), (4, "allgather"),
                                                   (4, "ring"))]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
