"""Lightning + fp.optim.Muon + AdamW (manual optimization, two optimizers) on the fsdp_plugin strategy.

    python lightning_muon.py --out OUT.json --ckpt-dir DIR [--resume CKPT]

Two CPU devices, 2 epochs of 2 batches; a checkpoint after every epoch. Rank 0 writes the per-batch losses
(global mean), the parameter shapes it saw and fp.comm_stats' Muon exchange count.
"""
from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import fsdp_plugin as fp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 12), nn.Linear(12, 5), nn.Linear(5, 1)   # 2 ranks cut a.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = Net()
        self.losses = []

    def configure_optimizers(self):
        named = list(self.net.named_parameters())
        mats = [p for n, p in named if n in ("a.weight", "b.weight")]
        rest = [p for n, p in named if n not in ("a.weight", "b.weight")]
        return [fp.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        self.losses.append((self.current_epoch, batch_idx, g.item() / dist.get_world_size()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--ckpt-dir")
    p.add_argument("--resume", default=None)
    a = p.parse_args()
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = Module()
    ckpt = ModelCheckpoint(dirpath=a.ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp_plugin", max_epochs=2, callbacks=[ckpt],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader, ckpt_path=a.resume)
    if trainer.global_rank == 0:
        shapes = {n: list(q.shape) for n, q in model.net.named_parameters()}
        with open(a.out, "w") as f:
            json.dump({"losses": model.losses, "shapes": shapes,
                       "exchanges": fp.comm_stats.calls.get("optim_exchange", 0)}, f)


if __name__ == "__main__":
    main()
