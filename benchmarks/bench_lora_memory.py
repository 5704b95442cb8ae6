"""Per-rank memory of PEFT LoRA vs full fine-tuning on a sharded Llama (CPU, gloo, 2 ranks, fsdp_plugin).

    python benchmarks/bench_lora_memory.py [--hidden 512 --layers 4 --vocab 8192 --steps 3]

For each mode a fresh ``torchrun --nproc_per_node 2`` runs this file as a worker: a Llama from a config
(seed 0), ``get_peft_model`` (LoRA r=8 on q/k/v/o) for ``lora``, ``fp.shard`` (one unit per decoder
layer), AdamW over the trainable parameters, ``--steps`` steps of forward + backward + step. Reported per
rank (max over ranks): the bytes of parameter shards, of gradients that exist, and of optimizer state,
counted from the tensors; and the malloc peak during the steps (LD_PRELOAD counter of ``_mem.py``; -1
without a C compiler). The frozen base must add no gradient and no optimizer bytes: LoRA's grad and
optimizer bytes are those of the adapter alone. The machine is shared: `uptime` is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _model(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 2,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if a.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(a) -> None:
    import _mem
    import torch
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import fsdp_plugin as fp

    dist.init_process_group("gloo")
    rank, heap = dist.get_rank(), _mem.Heap()
    model = fp.shard(_model(a), auto_wrap_policy={LlamaDecoderLayer})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    heap.reset_peak()
    base = heap.live()
    for _ in range(a.steps):
        ids = torch.randint(0, a.vocab, (4, 128), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the grads: they are part of the steady state
    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    rep = {"rank": rank, "params_local": sum(p.numel() for p in params),
           "trainable_local": sum(p.numel() for p in params if p.requires_grad),
           "param_bytes": _bytes(params), "grad_bytes": _bytes(p.grad for p in params if p.grad is not None),
           "frozen_grads": sum(p.grad is not None for p in params if not p.requires_grad),
           "optim_bytes": _bytes(state), "heap_peak_steps": heap.peak() - base if heap.available else -1}
    with open(os.path.join(a.out, f"{a.mode}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    dist.destroy_process_group()


def launch(a, mode: str, out: str) -> dict:
    import _mem

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    so = _mem.build_heap_tracker()
    if so:
        env["LD_PRELOAD"] = (so + " " + env.get("LD_PRELOAD", "")).strip()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", "--mode", mode, "--out", out, "--hidden", str(a.hidden), "--layers", str(a.layers),
           "--vocab", str(a.vocab), "--steps", str(a.steps)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    reps = [json.load(open(os.path.join(out, f"{mode}_rank{r}.json"))) for r in range(2)]
    return {k: max(r[k] for r in reps) for k in reps[0] if k != "rank"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 4), ("vocab", 8192), ("steps", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", default="full")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    out = a.out or tempfile.mkdtemp(prefix="lora_mem_")
    res = {mode: launch(a, mode, out) for mode in ("full", "lora")}
    mb = lambda n: f"{n / 2**20:9.2f}" if n >= 0 else "      n/a"
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("mode   params/rank trainable/rank  param MB   grad MB  optim MB  heap peak MB (steps)  frozen grads")
    for mode, r in res.items():
        print(f"{mode:6} {r['params_local']:11d} {r['trainable_local']:14d} {mb(r['param_bytes'])} "
              f"{mb(r['grad_bytes'])} {mb(r['optim_bytes'])} {mb(r['heap_peak_steps']):>21} {r['frozen_grads']:13d}")
    f, lo = res["full"], res["lora"]
    print(f"lora/full: grad {lo['grad_bytes'] / f['grad_bytes']:.4f}, optim {lo['optim_bytes'] / f['optim_bytes']:.4f}, "
          f"heap peak {lo['heap_peak_steps'] / max(f['heap_peak_steps'], 1):.3f}")


if __name__ == "__main__":
    main()
