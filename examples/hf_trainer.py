"""TRL's ``SFTTrainer`` (a transformers ``Trainer`` subclass) fine-tuning a tiny Llama, sharded by fsdp_plugin.

The only change to a stock script is the import below. FSDP is selected the usual way, by the accelerate
config file (``distributed_type: FSDP``)::

    accelerate launch --config_file examples/accelerate_fsdp_trainer_cpu.yaml --main_process_port 0 \\
        examples/hf_trainer.py --out runs/sft --max-steps 20

or by ``SFTConfig(fsdp=True, fsdp_config={...})`` under ``torchrun`` (``--fsdp-args`` below). Checkpoints
(``--save-steps``) hold model + optimizer in fsdp_plugin's sharded format and resume at any process count
(``--resume runs/sft/checkpoint-10``); the final model is written as Hugging Face safetensors +
config that ``AutoModelForCausalLM.from_pretrained`` loads.
"""
from __future__ import annotations

import argparse
import json
import os

import fsdp_plugin.integrations.transformers  # the one-line change: Trainer (and subclasses) → fsdp_plugin
import _hardware
from _tiny_hf import text_dataset, tiny_llama, tokenizer
from trl import SFTConfig, SFTTrainer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sft")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 compute (fp32 master weights); default: on with a GPU that supports it, off on CPU")
    p.add_argument("--fsdp-args", action="store_true", help="select FSDP in SFTConfig instead of the accelerate config")
    p.add_argument("--resume", default=None, help="a checkpoint-<step> folder")
    return p.parse_args()


def resumed_step(checkpoint: str | None) -> int:
    """The optimizer step a ``checkpoint-<step>`` folder was saved at (0 when not resuming)."""
    if checkpoint is None:
        return 0
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        return int(json.load(f)["global_step"])


def main() -> None:
    a = parse()
    tok = tokenizer()
    fsdp = dict(fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}) if a.fsdp_args else {}
    args = SFTConfig(output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=4, learning_rate=3e-3,
                     max_grad_norm=1.0, logging_steps=5, save_steps=a.save_steps, max_length=96,
                     report_to=[], disable_tqdm=True, seed=0, **_hardware.trainer_flags(a.bf16), **fsdp)
    trainer = SFTTrainer(model=tiny_llama(len(tok)), args=args, train_dataset=text_dataset(), processing_class=tok)
    if trainer.is_world_process_zero():
        acc = trainer.accelerator
        print(_hardware.report(acc.num_processes, acc.device, acc.mixed_precision), flush=True)
    start = resumed_step(a.resume)
    if start >= a.max_steps and trainer.is_world_process_zero():  # say so: the Trainer would just return
        print(f"nothing left to train: {a.resume} is at step {start} and --max-steps {a.max_steps} is the total; "
              "pass a larger --max-steps")
    trainer.train(resume_from_checkpoint=a.resume)
    trainer.save_model(os.path.join(a.out, "final"))  # HF safetensors + config (+ tokenizer)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"sharded={fsdp_plugin.is_sharded(trainer.model)} step {trainer.state.global_step} (started at {start}) "
              f"losses={[round(x, 4) for x in losses]}")
        print(f"saved {os.path.join(a.out, 'final')}")


if __name__ == "__main__":
    main()
