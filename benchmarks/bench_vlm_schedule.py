"""The two exact schedules of a VLM tower whose images sit on some ranks only: held (declared in
``some_ranks_modules``: gathered every step at the root's pre-forward, held to the end of backward) vs on demand
(the default for a config with ``vision_config``: gathered only on steps where some rank's inputs hold images).

    .venv/bin/python benchmarks/bench_vlm_schedule.py [--model llava|qwen2vl] [--size tiny|small] [--rounds 4]

Both models are sharded in the same ranks (world 2, CPU, gloo, fp32, SGD) and run the same batch back to back
each step (paired; which goes first alternates). Steps cycle through the image patterns of
tests/test_some_ranks_vlm.py: images on rank 0 only, on no rank, on both, on rank 1 only. Per rank and
pattern: the growth of the malloc heap peak during the step over the live bytes before it (LD_PRELOAD counter
of ``_mem``: byte-exact, load-independent), the bytes this rank wrote to gloo's sockets (``wchar``), the median
step time (forward + backward + optimizer step) and the medians of the paired ratios of wall and of process
CPU time (all threads: less sensitive to load than wall); the first round is
warm-up. Also the time of the decision alone (200 calls). Prints the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import _mem  # noqa: E402

PATTERNS = ("rank 0", "none", "both", "rank 1")
HAS = {"rank 0": {0}, "none": set(), "both": {0, 1}, "rank 1": {1}}


def _llava(size: str):
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    h, layers, img = (16, 2, 8) if size == "tiny" else (256, 4, 32)
    vision = CLIPVisionConfig(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
                              num_attention_heads=2, image_size=img, patch_size=4)
    text = LlamaConfig(vocab_size=64, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=63,
                      image_seq_length=(img // 4) ** 2, vision_feature_layer=-1,
                      vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg), "CLIPVisionModel", img


def _llava_batch(rank: int, image: bool, img: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed * 7 + rank)
    n = (img // 4) ** 2
    ids = torch.randint(0, 63, (2, n + 8), generator=g)
    out = {"input_ids": ids}
    if image:
        ids[0, 1:1 + n] = 63
        out["pixel_values"] = torch.randn(1, 3, img, img, generator=g)
    out["labels"] = ids.clone()
    return out


def _qwen(size: str):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    th, vd, depth = (32, 16, 2) if size == "tiny" else (256, 128, 4)
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=th, intermediate_size=2 * th, num_hidden_layers=depth,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3] if th == 32
                                          else [16, 24, 24], "rope_theta": 1e4}),
        vision_config=dict(depth=depth, embed_dim=vd, hidden_size=th, num_heads=2, mlp_ratio=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
        image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg), "Qwen2VisionTransformerPretrainedModel", 8


def _qwen_batch(rank: int, image: bool, grid: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed * 7 + rank)
    tokens = (grid // 2) ** 2
    ids = torch.randint(0, 60, (2, tokens + 8), generator=g)
    out = {"input_ids": ids}
    if image:
        ids[0, 1], ids[0, 2:2 + tokens], ids[0, 2 + tokens] = 62, 60, 63
        out["pixel_values"] = torch.randn(grid * grid, 3 * 2 * 2 * 2, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, grid, grid]])
        out["mm_token_type_ids"] = (ids == 60).long()
    out["labels"] = ids.clone()
    return out


def _rank(rank, world, model_name, size, rounds):
    import gc

    import torch

    import fsdp_plugin as fp
    from _parity import make_optimizer

    build, batch = (_llava, _llava_batch) if model_name == "llava" else (_qwen, _qwen_batch)
    models = {}
    for name in ("held", "on_demand"):
        net, tower_cls, geom = build(size)
        rule = {tower_cls} if name == "held" else None
        model = fp.shard(net, some_ranks_modules=rule, timeout_s=300)
        models[name] = (model, make_optimizer("sgd", model.parameters()))
    heap = _mem.Heap()
    out = {n: {p: {"heap": [], "time": [], "sent": [], "cpu": []} for p in PATTERNS} for n in models}
    for r in range(rounds):
        for i, pattern in enumerate(PATTERNS):
            data = batch(rank, rank in HAS[pattern], geom, r * 4 + i)
            order = list(models.items()) if (r + i) % 2 == 0 else list(models.items())[::-1]   # no order bias
            for name, (model, opt) in order:
                gc.collect()
                live, sent = heap.reset_peak(), _mem.bytes_sent()
                t, c = time.perf_counter(), time.process_time()
                model(**data).loss.backward()
                opt.step()
                opt.zero_grad()
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                if r > 0:
                    out[name][pattern]["heap"].append(heap.peak() - live)
                    out[name][pattern]["time"].append(wall)
                    out[name][pattern]["sent"].append(_mem.bytes_sent() - sent)
                    out[name][pattern]["cpu"].append(cpu)
    tower = models["held"][0]._fp_root.some_ranks_units[0]
    held = sum(h.padded * h.compute_dtype.itemsize for h in tower.handles)
    from fsdp_plugin._schedule.on_demand import any_rank_holds
    t = time.perf_counter()
    for _ in range(200):                  # the decision alone: one 1-byte MAX all-reduce on the gloo control group
        any_rank_holds(rank == 0, 60.0)
    decision = (time.perf_counter() - t) / 200
    return {"rank": rank, "tower_bytes": held, "out": out, "decision_s": decision}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("llava", "qwen2vl"), default="llava")
    ap.add_argument("--size", choices=("tiny", "small"), default="small")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    lib = _mem.build_heap_tracker()
    if lib and "libheaptrack" not in os.environ.get("LD_PRELOAD", ""):  # re-exec with the heap counter
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": lib})
    from _dist import run_ranks

    res = run_ranks(_rank, 2, args.model, args.size, args.rounds, timeout=1800)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{args.model} {args.size}: tower full parameters {res[0]['tower_bytes'] / 1e6:.3f} MB; the decision "
          f"alone {res[0]['decision_s'] * 1e6:.0f} us; load {load}")
    print("pattern  | rank | heap peak held MB | on demand MB | sent held MB | on demand MB | step held ms | "
          "on demand ms | ratio | CPU ratio")
    for p in PATTERNS:
        for r in res:
            h, d = r["out"]["held"][p], r["out"]["on_demand"][p]
            th, td = statistics.median(h["time"]) * 1e3, statistics.median(d["time"]) * 1e3
            ratio = statistics.median(b / a for a, b in zip(h["time"], d["time"]))   # of the paired steps
            cpu = statistics.median(b / a for a, b in zip(h["cpu"], d["cpu"]))       # process CPU time, paired
            sh, sd = statistics.median(h["sent"]) / 1e6, statistics.median(d["sent"]) / 1e6
            print(f"{p:8} | {r['rank']:4} | {max(h['heap']) / 1e6:17.3f} | {max(d['heap']) / 1e6:12.3f} | "
                  f"{sh:12.3f} | {sd:12.3f} | {th:12.1f} | {td:12.1f} | {ratio:5.3f} | {cpu:.3f}")


if __name__ == "__main__":
    main()
