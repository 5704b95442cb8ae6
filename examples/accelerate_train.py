"""A typical Accelerate training script, sharded by fsdp_plugin: the only change is the import.

    accelerate launch --config_file examples/accelerate_fsdp_cpu.yaml --main_process_port 0 \
        examples/accelerate_train.py --steps 20 --save-state ckpt --save-model final
    # on GPUs (one process per GPU, NCCL, bf16): examples/accelerate_fsdp_gpu.yaml instead
    # continue to step 40 (--steps is the total, as in the other examples)
    accelerate launch --config_file examples/accelerate_fsdp_cpu.yaml --main_process_port 0 \
        examples/accelerate_train.py --steps 40 --resume ckpt

A small byte-level GPT (one FSDP unit per ``Block``, as the yaml's ``fsdp_transformer_layer_cls_to_wrap``
says) learns the Python standard library's source code (no download). ``--resume ckpt`` continues
from a ``save_state`` directory, on any number of processes; ``--save-model DIR`` writes Hugging
Face safetensors that a plain ``GPT()`` loads.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import _hardware
from _text import VOCAB, load_corpus
from fsdp_plugin.integrations.accelerate import Accelerator  # was: from accelerate import Accelerator


class Block(nn.Module):
    """Pre-LN transformer block (causal self-attention + MLP)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT with tied input/output embeddings."""

    _no_split_modules = ["Block"]  # the FSDP units when a config names no classes (accelerate_fsdp_gpu.yaml)

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Windows(Dataset):
    """Consecutive ``seq + 1``-byte windows of the corpus: (input, next-byte target)."""

    def __init__(self, corpus: torch.Tensor, seq: int):
        self.data, self.seq = corpus.long(), seq

    def __len__(self):
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i):
        chunk = self.data[i * self.seq: (i + 1) * self.seq + 1]
        return chunk[:-1], chunk[1:]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="train up to this optimizer step (total, across resumes)")
    ap.add_argument("--batch-size", type=int, default=8, help="per-process micro-batch")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-state", help="save_state directory (written at the end)")
    ap.add_argument("--resume", help="load_state directory to continue from")
    ap.add_argument("--save-model", help="directory for HF safetensors of the trained model")
    return ap.parse_args()


def train(accelerator, model, optimizer, scheduler, loader, start: int, steps: int) -> int:
    """Optimizer steps ``start + 1 .. steps`` (fewer if the data runs out); returns the last step done."""
    done = start
    batches = accelerator.skip_first_batches(loader, accelerator.step) if accelerator.step else loader
    for x, y in batches:
        if done >= steps:
            break
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            mean = accelerator.reduce(loss.detach(), "mean").item()
            accelerator.print(f"step {done:4d}  loss {mean:.4f}  grad-norm {norm.item():.3f}")
    return done


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    accelerator.print(_hardware.report(accelerator.num_processes, accelerator.device, accelerator.mixed_precision))
    torch.manual_seed(0)
    model = GPT(seq=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # before prepare: still valid after it
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    loader = DataLoader(Windows(load_corpus(1 << 20), args.seq), batch_size=args.batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if args.resume:
        accelerator.load_state(args.resume)
    start = accelerator.step // args.grad_accum
    accelerator.print(f"sharding: {accelerator.fsdp_settings.describe() if accelerator.fsdp_settings else None}")
    if args.resume:
        accelerator.print(f"resumed from {args.resume} at step {start}")
    if start >= args.steps:  # say so: a resume that trains nothing must not look like a silent success
        accelerator.print(f"nothing left to train: the state is at step {start} and --steps {args.steps} is the "
                          f"total; pass --steps {start + args.steps} to train {args.steps} more")
    done = train(accelerator, model, optimizer, scheduler, loader, start, args.steps)
    if done > start:
        accelerator.print(f"trained steps {start + 1}..{done}")
    if done < args.steps:
        accelerator.print(f"the data ran out at step {done} (one pass over the corpus), before --steps {args.steps}")
    if args.save_state:
        accelerator.save_state(args.save_state)
        accelerator.print(f"saved state to {args.save_state} at step {done}")
    if args.save_model:
        accelerator.save_model(model, args.save_model)
        accelerator.print(f"saved Hugging Face safetensors to {args.save_model}")
    accelerator.end_training()  # barrier, then the process group is destroyed cleanly (fp.shutdown)


if __name__ == "__main__":
    main()
