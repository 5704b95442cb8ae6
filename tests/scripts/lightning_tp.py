"""``FSDPPluginStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with Lightning's own launcher (4 CPU
processes, gloo), driven by tests/test_lightning_tensor_parallel.py. The LightningModule is written as for
Lightning's ModelParallelStrategy: ``configure_model`` parallelizes on ``self.device_mesh["tensor_parallel"]``.

    python lightning_tp.py OUT_DIR

Every rank writes ``OUT_DIR/rank<r>.json``: per step its loss and the sample indices of its batch.
"""
from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _tp  # noqa: E402  the toy GPT with every TP case, its plan, data and optimizer

from fsdp_plugin.integrations.lightning import FSDPPluginStrategy  # noqa: E402

STEPS = 3


class Data(torch.utils.data.Dataset):
    """Sample i: row i % 4 of global batch i // 4 (``_tp.global_batch``), with its index."""

    def __len__(self) -> int:
        return 4 * STEPS

    def __getitem__(self, i: int):
        idx, tgt = _tp.global_batch(i // 4)
        return i, idx[i % 4], tgt[i % 4]


class TPModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _tp.TPGPT()
        self.seen: list = []

    def configure_model(self) -> None:          # ModelParallelStrategy's contract, without fully_shard
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], _tp.tp_plan())

    def training_step(self, batch, batch_idx):
        i, idx, tgt = batch
        loss = self.model(idx, tgt)
        self.seen.append((i.tolist(), loss.item()))
        return loss

    def configure_optimizers(self):
        return _tp.make_optimizer("adamw", self.parameters())


def main() -> None:
    out = sys.argv[1]
    module = TPModule()
    strategy = FSDPPluginStrategy(data_parallel_size=2, tensor_parallel_size=2, auto_wrap_policy={_tp.TPBlock})
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(Data(), batch_size=2))
    trainer.save_checkpoint(os.path.join(out, "final.ckpt"))
    rank = trainer.global_rank
    rep = {"seen": module.seen, "mesh": list(strategy.device_mesh.mesh_dim_names),
           "module_mesh": module.device_mesh is strategy.device_mesh, "world": trainer.world_size,
           "params": {k: v.reshape(-1)[:6].tolist() for k, v in _full(module).items()}}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rep, f)


def _full(module) -> dict:
    import fsdp_plugin as fp

    full = fp.full_state_dict(module, rank0_only=False)     # the LightningModule is the sharded root
    return {k.removeprefix("model."): v for k, v in full.items()}


if __name__ == "__main__":
    main()
