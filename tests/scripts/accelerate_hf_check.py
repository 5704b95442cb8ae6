"""A Hugging Face transformers model under ``accelerate launch`` with fsdp_plugin's Accelerator.

Random init from a tiny GPT-2 config (nothing downloaded). Rank 0 builds real weights and the other
ranks build on the meta device (what transformers' ``cpu_ram_efficient_loading`` does), so ``prepare``
must scatter rank 0's weights. Wrapping comes from the model's ``_no_split_modules`` (GPT2Block).

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

    import fsdp_plugin as fp

    out = sys.argv[1]
    accelerator = Accelerator()
    model = build_model(real=accelerator.is_main_process)
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
              "wrap": sorted(c.__name__ for c in wrap), "local_numel": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.print("ACCELERATE_CHECK_DONE")


if __name__ == "__main__":
    main()
