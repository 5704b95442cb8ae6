"""Fabric(strategy="fsdp_plugin") script driven by tests/test_lightning_integration.py (run as a subprocess).

    python fabric_train.py OUT.json CKPT_DIR [DEVICES]

Deferred init (``fabric.init_module(empty_init=True)``), ``setup``, accumulation with
``no_backward_sync``, ``clip_gradients(max_norm)``, ``save`` after 4 steps, 2 more steps, then a fresh
model loaded with ``load`` must repeat those 2 steps exactly. Rank 0 also trains a plain single-process
reference on the same global batches; OUT.json gets both loss curves.
"""
from __future__ import annotations

import json
import sys

import torch
from lightning.fabric import Fabric

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from lightning_train import GLOBAL_BATCH, Net, dataset

ACCUM, CLIP, LR = 2, 0.05, 3e-3


def build(fabric: Fabric):
    """A deferred-init model and its optimizer, set up by Fabric."""
    torch.manual_seed(1234)
    with fabric.init_module(empty_init=True):
        model = Net()
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, optimizer


def micro_batches(step: int, rank: int, world: int):
    x, y = dataset().tensors
    idx = torch.arange((step % 4) * GLOBAL_BATCH, (step % 4 + 1) * GLOBAL_BATCH)[rank::world]
    return [(x[i], y[i]) for i in idx.chunk(ACCUM)]


def train_step(fabric: Fabric, model, optimizer, step: int) -> float:
    losses = []
    for j, (x, y) in enumerate(micro_batches(step, fabric.global_rank, fabric.world_size)):
        with fabric.no_backward_sync(model, enabled=j < ACCUM - 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / ACCUM)
        losses.append(loss.detach())
    norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
    optimizer.step()
    optimizer.zero_grad()
    return float(fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean")), float(norm)


def reference(steps: int) -> list[float]:
    torch.manual_seed(1234)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = dataset().tensors
    out = []
    for step in range(steps):
        sl = slice((step % 4) * GLOBAL_BATCH, (step % 4 + 1) * GLOBAL_BATCH)
        loss = torch.nn.functional.mse_loss(model(x[sl]), y[sl])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        out.append(float(loss))
    return out


def main() -> None:
    out_path, ckpt_dir = sys.argv[1], sys.argv[2]
    devices = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    import fsdp_plugin  # noqa: F401  - registers "fsdp_plugin"

    fabric = Fabric(accelerator="cpu", devices=devices, strategy="fsdp_plugin")
    fabric.launch()
    model, optimizer = build(fabric)
    curve = [train_step(fabric, model, optimizer, s) for s in range(4)]
    fabric.save(ckpt_dir, {"model": model, "optimizer": optimizer, "step": 4, "note": ("tuple", float("inf"))})
    after = [train_step(fabric, model, optimizer, s) for s in range(4, 6)]
    model2, optimizer2 = build(fabric)
    state = {"model": model2, "optimizer": optimizer2, "step": 0, "note": None}
    fabric.load(ckpt_dir, state)
    resumed = [train_step(fabric, model2, optimizer2, s) for s in range(state["step"], 6)]
    if fabric.global_rank == 0:
        report = {"losses": [c[0] for c in curve + after], "norms": [c[1] for c in curve + after],
                  "resumed": [r[0] for r in resumed], "reference": reference(6), "step": state["step"],
                  "note": list(state["note"]), "strategy": type(fabric.strategy).__name__,
                  "world_size": fabric.world_size}
        with open(out_path, "w") as f:
            json.dump(report, f)
        print("REPORT", json.dumps(report), file=sys.stderr)


if __name__ == "__main__":
    main()
