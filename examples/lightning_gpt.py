"""A character-level GPT trained with Lightning on fsdp_plugin: `import fsdp_plugin` + strategy="fsdp_plugin".

The text is Python's own documentation (``pydoc_data.topics``, shipped with CPython): no downloads.

    # 2 GPUs (NCCL, bf16-mixed where supported) when there are GPUs, else 2 CPU processes (gloo, 32-true);
    # the first line printed says which. ModelCheckpoint writes sharded checkpoint directories under out/gpt/
    python examples/lightning_gpt.py --devices 2 --max-steps 40
    # resume from out/gpt/last.ckpt (any number of devices) and keep training
    python examples/lightning_gpt.py --devices 2 --max-steps 80 --resume last

The model is built in ``configure_model`` (deferred init: materialized already sharded, block by block).
"""
from __future__ import annotations

import argparse
import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

import _hardware
import fsdp_plugin  # the one-line change: registers strategy="fsdp_plugin" with Lightning


def corpus() -> str:
    """About 460 kB of English technical prose that ships with Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class CharData(torch.utils.data.Dataset):
    """Fixed windows of ``ctx + 1`` characters (input and next-character target)."""

    def __init__(self, text: str, ctx: int) -> None:
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.ctx = ctx

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.ctx

    def __getitem__(self, i: int):
        chunk = self.data[i * self.ctx: i * self.ctx + self.ctx + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block; the default wrap policy makes each one an FSDP unit."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class LitGPT(pl.LightningModule):
    def __init__(self, vocab: list[str], ctx: int = 64, dim: int = 128, layers: int = 4, heads: int = 4,
                 lr: float = 3e-3, max_steps: int = 40) -> None:
        super().__init__()
        self.save_hyperparameters()  # JSON-able values only: checkpoints are pickle-free
        self.gpt = None

    def configure_model(self) -> None:
        if self.gpt is None:  # runs under fp.deferred_init(): no memory until the strategy shards it
            h = self.hparams
            self.gpt = GPT(len(h.vocab), h.ctx, h.dim, h.layers, h.heads)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warm = 10

        def schedule(step: int) -> float:
            frac = min(1.0, step / max(1, self.hparams.max_steps))
            return min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @torch.no_grad()
    def sample(self, prompt: str, n: int = 200) -> str:
        """Greedy continuation. Collective: every rank runs the sharded forward passes together."""
        vocab = self.hparams.vocab
        idx = torch.tensor([[vocab.index(c) for c in prompt if c in vocab]], device=self.device)
        for _ in range(n):
            logits = self(idx[:, -self.hparams.ctx:])[:, -1]
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
        return "".join(vocab[i] for i in idx[0].tolist())


class ReportSteps(pl.Callback):
    """Says where training starts (and, after fit, whether it ran at all): a resume past ``max_steps`` trains
    nothing, and Lightning then skips the loop without calling any training hook."""

    started = False

    def on_train_start(self, trainer, pl_module) -> None:
        self.started = True
        if trainer.is_global_zero:
            first = "resumed at" if trainer.global_step else "starting at"
            print(f"{first} step {trainer.global_step}, training to step {trainer.max_steps}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="GPUs (at most the machine's), or CPU processes")
    p.add_argument("--accelerator", default="auto", choices=("auto", "gpu", "cpu"),
                   help="auto: the GPUs when there are any, else the CPU")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--ckpt-dir", default="out/gpt")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and last.ckpt)")
    p.add_argument("--sample", type=int, default=120, help="characters to generate after training")
    p.add_argument("--resume", default=None, help='a checkpoint directory, or "last"')
    p.add_argument("--precision", default=None,
                   help="32-true | bf16-mixed | bf16-true | 16-mixed (GPU); default: bf16-mixed on a GPU with bf16, "
                        "else 32-true")
    args = p.parse_args()
    accelerator, devices, precision, hardware = _hardware.lightning(args.devices, args.accelerator, args.precision)
    if _hardware.is_launcher_process():
        print(hardware, flush=True)

    pl.seed_everything(0)
    data = CharData(corpus(), ctx=64)
    model = LitGPT(data.vocab, max_steps=args.max_steps)
    report = ReportSteps()
    trainer = pl.Trainer(
        accelerator=accelerator, devices=devices, strategy="fsdp_plugin", precision=precision,
        max_steps=args.max_steps, log_every_n_steps=5, logger=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(args.ckpt_dir, every_n_train_steps=args.save_every, save_last=True), report],
    )
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=0)
    trainer.fit(model, loader, ckpt_path=args.resume)
    if not report.started and trainer.is_global_zero:
        print(f"nothing left to train: the checkpoint is at step {trainer.global_step} and --max-steps "
              f"{args.max_steps} is the total; pass a larger --max-steps")
    text = model.sample("The \"assert\" statement", n=args.sample)
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("train_loss")
        print(f"\nstep {trainer.global_step}" + (f", train_loss {float(loss):.3f}" if loss is not None else ""))
        print(f"checkpoints: {sorted(p.name for p in __import__('pathlib').Path(args.ckpt_dir).iterdir())}")
        print("sample:", text)
    fsdp_plugin.shutdown()  # every rank: barrier, then the process group is destroyed cleanly (README, Reliability)


if __name__ == "__main__":
    main()
