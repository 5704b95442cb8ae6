"""Uneven training batches under ``Trainer(strategy="fsdp_plugin")``, driven by tests/test_lightning_uneven.py.

    python lightning_uneven.py OUT_DIR [--iterable] [--accumulate N] [--val-counts A B]

Two ranks (Lightning's launcher), ``use_distributed_sampler=False``: rank r trains on ``COUNTS[r]`` batches
per epoch (rank 0 is the short one: its Lightning state is what checkpoints hold), SGD with momentum, a
step-interval StepLR, 2 epochs with validation (``sync_dist``), ModelCheckpoint every epoch and a final
``trainer.save_checkpoint``. Each rank writes ``OUT_DIR/rank{r}.json``: its local loss per real step, its
global_step, lr, the validation loss and (rank 0) the full weights as lists. :func:`reference` is the same
training in one process on the global data of each step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_train import Net  # noqa: E402

COUNTS = (3, 5)
BATCH = 4
DIM = 16
EPOCHS = 2


def rank_batches(rank: int, n: int) -> list:
    g = torch.Generator().manual_seed(10 + rank)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(n):
        x = torch.randn(BATCH, DIM, generator=g)
        out.append((x, x @ w + 0.1 * torch.randn(BATCH, 1, generator=g)))
    return out


def val_batches(rank: int, n: int = 2) -> list:
    return rank_batches(100 + rank, n)


def build() -> Net:
    torch.manual_seed(1234)
    return Net()


def make_opt(params):
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def reference(counts=COUNTS, accumulate: int = 1, max_steps: int = -1, val_counts=(2, 2)) -> dict:
    """One process: at micro-batch k the loss is sum over ranks with a batch k of their mean loss / world
    (the joined ranks' samples count zero, gradients divided by the initial world size). Validation after
    each epoch that reached its last batch (Lightning does not validate where ``max_steps`` cuts an epoch)."""
    model, world = build(), len(counts)
    opt, sched = make_opt(model.parameters())
    data = [rank_batches(r, n) for r, n in enumerate(counts)]
    losses, steps, val = [[] for _ in counts], 0, None
    for _ in range(EPOCHS):
        for k in range(max(counts)):
            if steps == max_steps:
                break
            total = 0.0
            for r in range(world):
                if k < counts[r]:
                    x, y = data[r][k]
                    loss = nn.functional.mse_loss(model(x), y)
                    losses[r].append(float(loss.detach()))
                    total = total + loss / world
            (total / accumulate).backward()
            if (k + 1) % accumulate == 0 or k + 1 == max(counts):
                opt.step()
                sched.step()
                opt.zero_grad()
                steps += 1
        else:
            with torch.no_grad():   # sync_dist: sums and batch sizes summed over ranks, i.e. the mean of all batches
                val = sum(float(nn.functional.mse_loss(model(x), y)) for r, n in enumerate(val_counts)
                          for x, y in val_batches(r, n))
            continue
        break
    return {"losses": losses, "lr": opt.param_groups[0]["lr"], "val_loss": val / sum(val_counts), "steps": steps,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


class Iterable(torch.utils.data.IterableDataset):
    """No ``__len__``: Lightning prefetches one batch to know which is the last."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def loader(batches: list, iterable: bool):
    data = Iterable(batches) if iterable else batches
    return torch.utils.data.DataLoader(data, batch_size=None)


def main() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    import fsdp_plugin as fp

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--counts", type=int, nargs=2, default=COUNTS)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--val-counts", type=int, nargs=2, default=(2, 2), help="validation batches per rank")
    p.add_argument("--manual", action="store_true", help="manual optimization (not shadowed: UsageError if uneven)")
    args = p.parse_args()
    out = Path(args.out)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build()
            self.losses: list = []
            self.automatic_optimization = not args.manual

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)  # the shadow replays it
            if args.manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                self.lr_schedulers().step()
                return {"loss": loss.detach()}
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):  # real batches only (a shadow replays training_step)
            self.losses.append(float(outputs["loss"]))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            opt, sched = make_opt(self.parameters())
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp_plugin", max_epochs=EPOCHS, max_steps=args.max_steps,
                         use_distributed_sampler=False, accumulate_grad_batches=args.accumulate, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(out / "ck", save_top_k=-1, every_n_epochs=1)])
    model = Module()
    rank = trainer.global_rank
    trainer.fit(model, loader(rank_batches(rank, args.counts[rank]), args.iterable),
                loader(val_batches(rank, args.val_counts[rank]), args.iterable))
    trainer.save_checkpoint(out / "final.ckpt")
    weights = {k: v.tolist() for k, v in fp.full_state_dict(model).items()}
    report = {"losses": model.losses, "global_step": trainer.global_step,
              "lr": trainer.optimizers[0].param_groups[0]["lr"],
              "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))), "epoch": trainer.current_epoch,
              "weights": weights if rank == 0 else None}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
