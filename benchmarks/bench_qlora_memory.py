"""Per-rank memory of a QLoRA base (bitsandbytes nf4, CPU, gloo): sharded by fsdp_plugin vs replicated.

    python benchmarks/bench_qlora_memory.py [--hidden 512 --layers 4 --vocab 8192 --steps 3 --worlds 1 2 4] [--bits 8]

A Llama from a config (seed 0) is written with ``save_pretrained`` and loaded by every rank with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=float32)``, LoRA r=8
on q/k/v/o, then ``fp.shard`` (one unit per decoder layer) and ``--steps`` AdamW steps. Two layouts:

* ``sharded``: the packed 4-bit bytes are sharded (fsdp_plugin, this repo);
* ``replicated``: the 4-bit layers are kept whole on every rank (``ignored_modules``), what accelerate's 2026
  FSDP-QLoRA answer does for the base (the rest is sharded the same way).

Reported per rank (max over ranks): the packed 4-bit bytes held, the ``quant_state`` bytes (whole on every
rank either way; ``--bits 8``: ``Linear8bitLt`` int8 rows and their ``SCB`` row scales), all parameter bytes, and the malloc peak during the steps (LD_PRELOAD counter of ``_mem.py``;
-1 without a C compiler). The machine is shared: ``uptime`` is printed with the table.

``--load``: the 70B question instead, does the *load* fit. Peak host memory per rank from process start to a
sharded, loaded 4-bit model, for

* ``from_pretrained``: ``from_pretrained(quantization_config=...)`` on every rank (the whole base read and
  quantized in every process), LoRA, then ``fp.shard``;
* ``deferred``: the skeleton under ``fp.deferred_init()`` (``replace_with_bnb_linear``, LoRA), ``fp.shard``, then
  ``fp.load_pretrained``: each rank reads and quantizes only its piece of the full-precision checkpoint.

Reported per rank (max over ranks): the malloc peak during the load, what is still live after it, the RSS high-water
mark's growth (includes the safetensors file pages a rank touched through mmap: page cache, not heap) and the load's
wall time. Both paths give bit-identical packed bytes (``tests/test_qlora_deferred.py``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _save_base(a, path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 2,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _model(path: str, bits: int = 4):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32) \
        if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).train()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _quant_state_bytes(p) -> int:
    if getattr(p, "quant_state", None) is None:     # 8-bit: one fp32 row scale per row
        return p.SCB.numel() * p.SCB.element_size()
    qs = p.quant_state
    return sum(t.numel() * t.element_size() for t in qs.as_dict(packed=True).values() if hasattr(t, "numel"))


def _deferred(path: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations import replace_with_bnb_linear

    import fsdp_plugin as fp

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    with fp.deferred_init():
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(path))
        model = replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=q)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model.train()


def load_worker(a) -> None:
    import time

    import _mem
    import bitsandbytes as bnb
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import fsdp_plugin as fp
    for name in ("peft", "transformers.integrations"):   # imported before the baseline: the RSS growth is the load's
        importlib.import_module(name)

    dist.init_process_group("gloo")
    rank, heap = dist.get_rank(), _mem.Heap()
    dist.barrier()
    base, rss0 = heap.reset_peak(), _mem.rss()
    _mem.reset_rss_peak()
    t0 = time.perf_counter()
    if a.mode == "from_pretrained":
        model = _model(a.base, 4)
        fp.shard(model, auto_wrap_policy={LlamaDecoderLayer})
    else:
        model = _deferred(a.base)
        fp.shard(model, auto_wrap_policy={LlamaDecoderLayer})
        assert not fp.load_pretrained(model, a.base)
    dist.barrier()
    seconds = time.perf_counter() - t0
    packed = [p for p in model.parameters() if isinstance(p, bnb.nn.Params4bit)]
    rep = {"rank": rank, "packed_bytes": _bytes(packed), "heap_peak_load": heap.peak() - base if heap.available else -1,
           "heap_after_load": heap.live() - base if heap.available else -1,
           "rss_peak_growth": _mem.rss_peak() - rss0, "load_s": seconds}
    with open(os.path.join(a.out, f"{a.mode}_w{a.world}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    dist.destroy_process_group()


def worker(a) -> None:
    import _mem
    import bitsandbytes as bnb
    import torch
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import fsdp_plugin as fp

    dist.init_process_group("gloo")
    rank, heap = dist.get_rank(), _mem.Heap()
    model = _model(a.base, a.bits)
    layers = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    ignored = [m for m in model.modules() if isinstance(m, layers)] if a.mode == "replicated" else []
    fp.shard(model, auto_wrap_policy={LlamaDecoderLayer}, ignored_modules=ignored)
    packed = [p for p in model.parameters() if isinstance(p, (bnb.nn.Params4bit, bnb.nn.Int8Params))]
    scales = sum(map(_quant_state_bytes, packed))   # before a forward: bitsandbytes' own 8-bit path moves SCB away
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    heap.reset_peak()
    base = heap.live()
    for _ in range(a.steps):
        ids = torch.randint(0, a.vocab, (4, 128), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    rep = {"rank": rank, "packed_bytes": _bytes(packed), "quant_state_bytes": scales,
           "param_bytes": _bytes(model.parameters()),
           "heap_peak_steps": heap.peak() - base if heap.available else -1}
    with open(os.path.join(a.out, f"{a.mode}_w{a.world}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    dist.destroy_process_group()


def launch(a, mode: str, world: int, out: str) -> dict:
    import _mem

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    so = _mem.build_heap_tracker()
    if so:
        env["LD_PRELOAD"] = (so + " " + env.get("LD_PRELOAD", "")).strip()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", __file__,
           "--worker", "--mode", mode, "--world", str(world), "--out", out, "--base", a.base,
           "--vocab", str(a.vocab), "--steps", str(a.steps), "--bits", str(a.bits)] + ["--load"] * a.load
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    reps = [json.load(open(os.path.join(out, f"{mode}_w{world}_rank{r}.json"))) for r in range(world)]
    return {k: max(r[k] for r in reps) for k in reps[0] if k != "rank"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 4), ("vocab", 8192), ("steps", 3), ("bits", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="sharded")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--base", default=None)
    p.add_argument("--load", action="store_true", help="peak memory of the load instead (module doc)")
    a = p.parse_args()
    if a.worker:
        return load_worker(a) if a.load else worker(a)
    out = a.out or tempfile.mkdtemp(prefix="qlora_mem_")
    a.base = os.path.join(out, "base")
    _save_base(a, a.base)
    mb = lambda n: f"{n / 2**20:9.2f}" if n >= 0 else "      n/a"
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    if a.load:
        return _print_load(a, out, mb)
    print(f"layout      world  {a.bits}-bit MB/rank  quant_state MB/rank  params MB/rank  heap peak MB (steps)")
    for world in a.worlds:
        for mode in ("sharded", "replicated"):
            r = launch(a, mode, world, out)
            print(f"{mode:11} {world:5d} {mb(r['packed_bytes']):>14} {mb(r['quant_state_bytes']):>20} "
                  f"{mb(r['param_bytes']):>15} {mb(r['heap_peak_steps']):>21}")


def _print_load(a, out: str, mb) -> None:
    import glob

    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(a.base, "*.safetensors")))
    print(f"checkpoint: {mb(weights).strip()} MB of fp32 safetensors")
    print("path             world  4-bit MB/rank  heap peak MB (load)  heap after MB  RSS peak growth MB  load s")
    for world in a.worlds:
        for mode in ("from_pretrained", "deferred"):
            r = launch(a, mode, world, out)
            print(f"{mode:15} {world:6d} {mb(r['packed_bytes']):>14} {mb(r['heap_peak_load']):>20} "
                  f"{mb(r['heap_after_load']):>14} {mb(r['rss_peak_growth']):>19} {r['load_s']:7.1f}", flush=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
