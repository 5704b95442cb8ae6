"""PEFT LoRA with a transformers ``Trainer`` on a sharded tiny Llama, then merge the adapter.

The only change to a stock script is the import below; FSDP comes from the accelerate config::

    accelerate launch --config_file examples/accelerate_fsdp_trainer_cpu.yaml --main_process_port 0 \\
        examples/peft_lora.py --out runs/lora --max-steps 20

Only the adapter trains: the frozen base is sharded but has no gradients and no optimizer state.
``model.save_pretrained`` (collective on the sharded model) writes the adapter alone; afterwards rank 0
consolidates: base weights + adapter → ``merge_and_unload()`` → ``runs/lora/merged`` (a plain model).
"""
from __future__ import annotations

import argparse
import os

import torch

import fsdp_plugin.integrations.transformers  # the one-line change: Trainer (and subclasses) → fsdp_plugin
import _hardware
from _tiny_hf import text_dataset, tiny_llama, tokenizer
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/lora")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 compute; default: on with a GPU that supports it, off on CPU")
    return p.parse_args()


def merge(out: str, tok) -> float:
    """Rank 0, no process group needed: base + adapter, merged; returns max |logits merged - unmerged|."""
    ids = torch.tensor([tok.encode("def main():\n    return 0\n")])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(os.path.join(out, "base")),
                                        os.path.join(out, "adapter")).eval()
    with torch.no_grad():
        before = adapted(input_ids=ids).logits
        merged = adapted.merge_and_unload()
        diff = (merged(input_ids=ids).logits - before).abs().max().item()
    merged.save_pretrained(os.path.join(out, "merged"))
    return diff


def main() -> None:
    a = parse()
    tok = tokenizer()
    args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=5, save_strategy="no", report_to=[],
                             disable_tqdm=True, seed=0, **_hardware.trainer_flags(a.bf16))
    base = tiny_llama(len(tok))
    if args.process_index == 0:
        base.save_pretrained(os.path.join(a.out, "base"))  # the weights the adapter will be merged into
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    data = text_dataset().map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    if trainer.is_world_process_zero():
        acc = trainer.accelerator
        print(_hardware.report(acc.num_processes, acc.device, acc.mixed_precision), flush=True)
    trainer.train()
    model.save_pretrained(os.path.join(a.out, "adapter"))  # collective; adapter weights only
    if trainer.is_world_process_zero():
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen_grads = sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
        print(f"sharded={fsdp_plugin.is_sharded(model)} trainable/rank={trainable} frozen_grads={frozen_grads}")
        print(f"adapter files: {sorted(os.listdir(os.path.join(a.out, 'adapter')))}")
        print(f"merged: max |logits merged - adapter| = {merge(a.out, tok):.2e}")


if __name__ == "__main__":
    main()
