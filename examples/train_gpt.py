"""Train a small GPT on real text with fsdp_plugin: one GPU per process (NCCL, bf16 where supported) when there
are GPUs, else CPU processes (gloo, float32); the first line printed says which.

    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 300 --save /tmp/ckpt
    torchrun --nproc_per_node 2 examples/train_gpt.py --steps 400 --resume /tmp/ckpt

The text is the Python standard library's own source code (ships with Python; no downloads), read as
bytes. The model is a decoder-only transformer: pre-LayerNorm blocks, causal attention, GELU MLP, token
embedding tied to the LM head. Every ``Block`` is one FSDP unit; the root unit owns the embeddings and the
final LayerNorm. Each rank trains on different batches; the printed loss is the mean over ranks.
``--save DIR`` writes a sharded checkpoint at the end (``fp.save_checkpoint``), ``--resume DIR`` loads one
(``fp.load_checkpoint``, any world size) and continues from its step up to ``--steps``.
Also runs without a launcher: ``python examples/train_gpt.py`` is world size 1.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hardware  # noqa: E402
import _text  # noqa: E402

import fsdp_plugin as fp  # noqa: E402


# ----------------------------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LN transformer block: the unit that fsdp_plugin shards."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # tied embeddings
        # GPT-2 style init, recorded too under fp.deferred_init()
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------- helpers
def init_distributed() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB, from /proc (0 where unavailable)."""
    cur = peak = 0.0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return cur, peak


def tensor_mb(tensors) -> float:
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total / 2**20


def mean_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def checkpoint_api():
    """(fp.save_checkpoint, fp.load_checkpoint), also where they are only in fsdp_plugin.checkpoint; None if absent."""
    try:
        import fsdp_plugin.checkpoint as ckpt
    except ImportError:
        ckpt = None
    return tuple(getattr(fp, name, None) or getattr(ckpt, name, None) for name in ("save_checkpoint", "load_checkpoint"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="train up to this step (total, across resumes)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    p.add_argument("--strategy", default="full_shard",
                   choices=["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
    p.add_argument("--deferred-init", action="store_true",
                   help="build the model under fp.deferred_init(): no full model is ever materialized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches evaluated at the end")
    p.add_argument("--save", metavar="DIR", help="write a sharded checkpoint here at the end")
    p.add_argument("--resume", metavar="DIR", help="load this checkpoint and continue from its step")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 parameters and compute, fp32 reduction and master weights; default: on with a GPU "
                        "that supports it, off on CPU")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    save_checkpoint, load_checkpoint = checkpoint_api()
    if (args.save and save_checkpoint is None) or (args.resume and load_checkpoint is None):
        sys.exit("this fsdp_plugin build has no fp.save_checkpoint / fp.load_checkpoint; run without --save/--resume")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    rank, world, device = init_distributed()
    log = print if rank == 0 else (lambda *a, **k: None)
    bf16 = _hardware.bf16_ok() if args.bf16 is None else args.bf16
    log(_hardware.report(world, device, "bf16-mixed" if bf16 else "32-true"), flush=True)

    train_data, val_data = _text.split(_text.load_corpus())
    log(f"data: {len(train_data) / 1e6:.2f} MB of Python stdlib source ({_text.stdlib_dir()}), byte tokens; "
        f"world {world}, {device.type}, {torch.get_num_threads()} thread(s) per rank")

    torch.manual_seed(args.seed)  # same init on every rank
    build = lambda: GPT(_text.VOCAB, args.seq, args.dim, args.layers, args.heads)  # noqa: E731
    if args.deferred_init:
        with fp.deferred_init():
            model = build()
    else:
        model = build().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # weight decay only on matrices (not biases, LayerNorms, position embeddings), decided before sharding;
    # sharded pieces keep their ndim and names survive fp.shard, so deciding after it gives the same groups.
    decay_names = {n for n, p in model.named_parameters() if p.dim() == 2 and "pos_emb" not in n}

    mp = fp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    cfg = fp.ShardingConfig(sharding_strategy=args.strategy, auto_wrap_policy={Block}, mixed_precision=mp)
    model = fp.shard(model, cfg)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay_names], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_params * 4 / 2**20:.1f} MB fp32), "
        f"{args.layers} blocks, strategy {args.strategy}, deferred init {args.deferred_init}")

    start = 0
    if args.resume:
        t = time.perf_counter()
        extra = load_checkpoint(args.resume, model, opt) or {}
        start = int(extra.get("step", 0))
        log(f"resumed from {args.resume} at step {start} ({time.perf_counter() - t:.2f} s)")
        if start >= args.steps:  # a resume that trains nothing says so
            log(f"nothing left to train: the checkpoint is at step {start} and --steps {args.steps} is the total; "
                f"pass --steps {start + args.steps} to train {args.steps} more")

    def lr_at(step: int) -> float:
        return args.lr * min(1.0, (step + 1) / max(args.warmup, 1))

    model.train()
    t_start, t_last, step = time.perf_counter(), time.perf_counter(), start
    first_loss = last_loss = None
    for step in range(start, args.steps):
        x, y = _text.get_batch(train_data, args.batch, args.seq, seed=args.seed, rank=rank, step=step)
        x, y = x.to(device), y.to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(x, y)
        loss.backward()
        if args.clip > 0:
            fp.clip_grad_norm_(model, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == start or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = mean_over_ranks(loss.item(), device)
            first_loss = mean if first_loss is None else first_loss
            last_loss = mean
            now = time.perf_counter()
            n = (step + 1 - start) % args.log_every or args.log_every
            log(f"step {step + 1:5d} | loss {mean:.4f} | {1000 * (now - t_last) / (1 if step == start else n):6.1f} ms/step")
            t_last = now
    steps_done = args.steps - start
    elapsed = time.perf_counter() - t_start
    if steps_done > 0:
        log(f"trained {steps_done} steps in {elapsed:.1f} s "
            f"({steps_done * args.batch * args.seq * world / elapsed:,.0f} tokens/s); "
            f"loss {first_loss:.4f} -> {last_loss:.4f}")

    # memory per rank: what this rank holds (sharded parameters, gradients, optimizer state) and its RSS
    params = [p for _, p in named]
    opt_state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    cur, peak = rss_mb()
    row = torch.tensor([tensor_mb(params), tensor_mb(opt_state), cur, peak], dtype=torch.float64, device=device)
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    for r, (pm, om, c, pk) in enumerate(t.tolist() for t in rows):
        log(f"memory rank {r}: live parameters {pm:.2f} MB (full model {n_params * 4 / 2**20:.2f} MB), "
            f"optimizer state {om:.2f} MB, RSS {c:.0f} MB (peak {pk:.0f} MB)")

    if args.eval_batches > 0:
        model.eval()
        with torch.no_grad():
            losses = []
            for i in range(args.eval_batches):
                x, y = _text.get_batch(val_data, args.batch, args.seq, seed=args.seed + 1, rank=rank, step=i)
                losses.append(model(x.to(device), y.to(device)).item())
        log(f"held-out loss {mean_over_ranks(sum(losses) / len(losses), device):.4f}")
        model.train()

    if args.save:
        t = time.perf_counter()
        save_checkpoint(args.save, model, opt, extra={"step": max(args.steps, start)})
        log(f"saved sharded checkpoint to {args.save} at step {max(args.steps, start)} "
            f"({time.perf_counter() - t:.2f} s)")
    # waits for every rank, then destroys the process group while Python is fully alive: a bare
    # destroy_process_group() can abort at exit on gloo (README, Known limits)
    fp.shutdown()


if __name__ == "__main__":
    main()
