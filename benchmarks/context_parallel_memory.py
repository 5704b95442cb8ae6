"""Activation memory per rank under context parallel (issue 54): the bytes autograd saves for backward in one
forward of a Llama-shaped model at a fixed sequence length, without CP (one process) and at cp 2 and 4 (forked
gloo ranks on this CPU), for both attention modes; the largest rank is reported.

    python benchmarks/context_parallel_memory.py [--seq 4096] [--out benchmarks/results_context_parallel_memory.json]

"Saved" counts every tensor autograd keeps (``torch.autograd.graph.saved_tensors_hooks``), each storage once:
the activation memory a step holds between forward and backward (without activation checkpointing), which is
what context parallel divides. The all-gather mode keeps the whole sequence's K/V of every layer
(S * 2 * Hkv * d per layer, not divided by C); Ulysses keeps H/C heads of the whole sequence.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=65536)


def _saved_bytes(model, batch) -> int:
    seen: dict = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(seen.values())


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
        return {"cp": 1, "method": "none", "saved_bytes_max_rank": _saved_bytes(_model(), _batch(seq)),
                "step_s": round(time.perf_counter() - start, 2)}
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
    return {"cp": cp, "method": method, "saved_bytes_max_rank": max(g[1] for g in got),
            "step_s": round(max(g[2] for g in got), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [measure(args.seq, 1, "none")]
    for cp in (2, 4):
        for method in ("allgather", "ulysses"):
            rows.append(measure(args.seq, cp, method))
    base = rows[0]["saved_bytes_max_rank"]
    for r in rows:
        r["vs_no_cp"] = round(r["saved_bytes_max_rank"] / base, 3)
        r["saved_MiB"] = round(r["saved_bytes_max_rank"] / 2**20, 1)
    result = {"seq": args.seq, "shape": SHAPE, "loadavg": os.getloadavg(), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
