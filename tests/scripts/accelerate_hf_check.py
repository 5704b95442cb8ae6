"""A Hugging Face transformers model under ``accelerate launch`` with fsdp_plugin's Accelerator.

A tiny GPT-2 (random init, nothing downloaded) is written by rank 0 with ``save_pretrained`` and read
back with ``from_pretrained`` on rank 0; the other ranks build it on the meta device (the shape that
``fsdp_cpu_ram_efficient_loading`` gives with older transformers), so ``prepare`` must scatter rank 0's
weights. Wrapping comes from the model's ``_no_split_modules`` (GPT2Block).

    accelerate launch --config_file CFG tests/scripts/accelerate_hf_check.py OUT
"""
from __future__ import annotations

import json
import os
import sys

import torch


def build_model(real: bool):
    """Tiny GPT-2 with tied embeddings; on meta when ``real`` is False."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    if real:
        return GPT2LMHeadModel(config)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def main() -> None:
    from fsdp_plugin.integrations.accelerate import Accelerator
    from transformers import GPT2LMHeadModel

    import fsdp_plugin as fp

    out = sys.argv[1]
    accelerator = Accelerator()
    pretrained = os.path.join(out, "pretrained")
    if accelerator.is_main_process:
        build_model(real=True).save_pretrained(pretrained)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        model = GPT2LMHeadModel.from_pretrained(pretrained)
    else:  # what cpu_ram_efficient_loading does with stock FSDP (transformers 5 loads real weights everywhere)
        model = build_model(real=False)
    loaded_on_meta = any(p.is_meta for p in model.parameters())
    original = {k: v.clone() for k, v in model.state_dict().items()} if accelerator.is_main_process else {}
    model = accelerator.prepare(model)
    full = accelerator.get_state_dict(model)
    same = all(torch.equal(full[k], v) for k, v in original.items()) and sorted(full) == sorted(original)
    opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    wrap = accelerator.sharding_configs[0].auto_wrap_policy
    report = {"is_sharded": fp.is_sharded(model), "scatter_matches_rank0": same, "losses": losses,
              "loaded_on_meta": loaded_on_meta,
              "wrap": sorted(c.__name__ for c in wrap), "local_numel": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.print("ACCELERATE_CHECK_DONE")


if __name__ == "__main__":
    main()
