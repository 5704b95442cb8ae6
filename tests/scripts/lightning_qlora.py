"""QLoRA through Lightning, driven by tests/test_qlora.py (a subprocess: Lightning's launcher re-runs it per rank).

    python lightning_qlora.py BASE_DIR OUT_DIR [--devices N] [--storage uint8|bfloat16] [--deferred]

The FSDP-QLoRA recipe of accelerate's and PEFT's docs with ``L.Trainer(strategy="fsdp_plugin")`` instead: a 4-bit
nf4 base from ``from_pretrained(quantization_config=...)`` (``tests/_qlora.py``), PEFT LoRA, AdamW, fp32 compute.
Rank r trains on ``_qlora.batch(step, r)``. Each rank writes ``OUT_DIR/lightning_rank<r>.json``: the global mean loss of
every step, and (after fit) how many weights are still ``Params4bit`` with a ``quant_state`` and the packed bytes
the rank holds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _qlora  # noqa: E402


class QLoRA(pl.LightningModule):
    def __init__(self, base: str, storage: torch.dtype) -> None:
        super().__init__()
        self.model = _qlora.build(base, storage)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=_qlora.LR)


class DeferredQLoRA(QLoRA):
    """The 70B path: the 4-bit skeleton with LoRA built in ``configure_model`` (under ``fp.deferred_init()``, which
    the strategy enters), the full-precision checkpoint loaded by ``fp.load_pretrained`` once the strategy sharded
    it (``on_fit_start``): each rank reads and quantizes only its piece."""

    def __init__(self, base: str, storage: torch.dtype) -> None:
        pl.LightningModule.__init__(self)
        self.base, self.storage, self.model = base, storage, None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        import transformers as tf

        if self.model is not None:
            return
        model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(self.base))
        model = tf.integrations.replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                                                        quantization_config=_qlora.quantization(self.storage))
        self.model = _qlora.add_lora(model).train()

    def on_fit_start(self) -> None:
        import fsdp_plugin as fp

        with expect_raises(fp.CheckpointError, "a submodule"):
            fp.load_pretrained(self.model, self.base)     # the PEFT model inside: not the sharded root
        assert not fp.load_pretrained(self, self.base)    # the root: the PEFT model's base names matched


def expect_raises(cls, text: str):
    """``pytest.raises`` for this script (no pytest in Lightning's launched ranks): ``cls`` whose text has ``text``."""
    import contextlib

    @contextlib.contextmanager
    def expect():
        try:
            yield
        except cls as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"{cls.__name__} not raised")
    return expect()


class RankBatches(torch.utils.data.Dataset):
    """This rank's batches: ``_qlora.batch(step, rank)`` for every step (already batched: ``batch_size=None``)."""

    def __len__(self) -> int:
        return _qlora.STEPS

    def __getitem__(self, step: int) -> torch.Tensor:
        return _qlora.batch(step, int(os.environ.get("LOCAL_RANK", 0)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("out")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--storage", default="uint8")
    p.add_argument("--deferred", action="store_true", help="DeferredQLoRA: skeleton + fp.load_pretrained")
    args = p.parse_args()
    import fsdp_plugin  # noqa: F401  - registers "fsdp_plugin" with Lightning

    module = (DeferredQLoRA if args.deferred else QLoRA)(args.base, getattr(torch, args.storage))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="fsdp_plugin", max_steps=_qlora.STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, torch.utils.data.DataLoader(RankBatches(), batch_size=None))
    report = {"losses": module.losses, "world_size": trainer.world_size,
              "strategy": type(trainer.strategy).__name__, "sharded": fsdp_plugin.is_sharded(module),
              **_qlora.packed_facts(module)}
    with open(os.path.join(args.out, f"lightning_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
