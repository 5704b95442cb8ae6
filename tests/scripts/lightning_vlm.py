"""A tiny Qwen2-VL inside a LightningModule under ``Trainer(strategy="fsdp_plugin")``, images on some ranks only
and nothing declared; driven by tests/test_some_ranks_qwen2vl.py.

    python lightning_vlm.py OUT_DIR

Two ranks (Lightning's launcher), ``use_distributed_sampler=False``: rank r trains on its own batches of
``test_some_ranks_qwen2vl``; each writes ``OUT_DIR/rank{r}.json`` (its local loss per step, the some-ranks units).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import test_some_ranks_qwen2vl as q  # noqa: E402


class VLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = q.tiny_qwen2vl()
        self.losses: list = []

    def training_step(self, batch, _):
        loss = self.net(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)    # _parity.make_optimizer("sgd")

    def train_dataloader(self):
        return torch.utils.data.DataLoader(q.rank_batches(self.trainer.global_rank), batch_size=None)


def main() -> None:
    out = Path(sys.argv[1])
    model = VLM()
    trainer = L.Trainer(strategy="fsdp_plugin", accelerator="cpu", devices=2, max_steps=q.STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    trainer.fit(model)
    units = [u.fqn for u in model._fp_root.some_ranks_units]
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"losses": model.losses, "units": units}))


if __name__ == "__main__":
    main()
