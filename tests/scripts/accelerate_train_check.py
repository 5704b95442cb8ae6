"""Training script run by ``accelerate launch`` in tests/test_accelerate_launch.py.

A typical accelerate loop (optimizer built *before* ``prepare``, ``accumulate``, ``clip_grad_norm_``,
scheduler, ``save_state``/``load_state``, ``save_model``) on a small MLP with ``Block`` units. Each
rank writes ``OUT/rank{r}.json`` with what the test asserts on: world, sharding, translated config,
per-micro-step losses, clipped norms and gradient-communication counts.

    accelerate launch --config_file CFG tests/scripts/accelerate_train_check.py OUT \
        [--steps N] [--save-at K STATE_DIR] [--resume STATE_DIR K] [--save-model DIR]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, ACCUM, SAMPLES, LR = 8, 2, 128, 0.05


class Block(nn.Module):
    """One transformer-like unit."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """Embed → 2 Blocks → head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def dataset() -> TensorDataset:
    """Deterministic regression data; targets scaled so that clipping at 1.0 is active."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = 2 * torch.randn(SAMPLES, 1, generator=g)
    return TensorDataset(x, y)


def build():
    """Model, optimizer and scheduler exactly as the single-process reference builds them."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched


class Counter:
    """A registered custom object (save_state/load_state must carry it)."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def grad_comm(before: dict, after: dict) -> dict:
    """Gradient-communication calls between two ``fp.comm_stats`` snapshots."""
    return {k: after["calls"].get(k, 0) - before["calls"].get(k, 0)
            for k in ("reduce_scatter", "all_reduce", "all_gather")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", nargs=2)
    ap.add_argument("--resume", nargs=2)
    ap.add_argument("--save-model")
    args = ap.parse_args()

    from accelerate import DataLoaderConfiguration
    from accelerate.utils import set_seed
    from fsdp_plugin.integrations.accelerate import Accelerator

    import fsdp_plugin as fp

    accelerator = Accelerator(gradient_accumulation_steps=ACCUM,
                              dataloader_config=DataLoaderConfiguration(split_batches=True))
    set_seed(0)
    model, opt, sched = build()
    total_numel = sum(p.numel() for p in model.parameters())
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    dl = DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    report = describe(accelerator, model, opt, total_numel, fp)

    start = 0
    if args.resume:
        accelerator.load_state(args.resume[0])
        start = int(args.resume[1])
        report["resumed_counter"] = counter.n
    report.update(train(accelerator, model, opt, sched, dl, counter, start, args, fp))
    if args.save_model:
        accelerator.save_model(model, args.save_model, max_shard_size="2KB")
        sd = accelerator.get_state_dict(model)
        report["state_dict_keys"] = sorted(sd)
    accelerator.wait_for_everyone()
    with open(os.path.join(args.out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.print("ACCELERATE_CHECK_DONE")


def describe(accelerator, model, opt, total_numel, fp) -> dict:
    """World, sharding and translated-config facts for the test."""
    import torch.distributed as dist

    cfg = accelerator.sharding_configs[0]
    wrap = cfg.auto_wrap_policy
    inner = getattr(opt, "optimizer", opt)
    return {
        "num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
        "pg_world": dist.get_world_size() if dist.is_initialized() else 1,
        "distributed_type": str(accelerator.distributed_type), "state_type": str(accelerator.state.distributed_type),
        "is_sharded": fp.is_sharded(model), "unwrap_is_model": accelerator.unwrap_model(model) is model,
        "local_numel": sum(p.numel() for p in model.parameters()), "total_numel": total_numel,
        "settings": accelerator.fsdp_settings.describe(), "strategy": cfg.sharding_strategy,
        "wrap": sorted(c.__name__ for c in wrap) if isinstance(wrap, set) else repr(wrap),
        "opt_params_are_model_params": [id(p) for g in inner.param_groups for p in g["params"]]
        == [id(p) for p in model.parameters()],
        "gathered": accelerator.gather_for_metrics(torch.tensor([accelerator.process_index])).tolist(),
    }


def train(accelerator, model, opt, sched, dl, counter, start, args, fp) -> dict:
    """Micro-steps ``start..steps``; save_state after micro-step ``--save-at K``."""
    losses, norms, comm, lrs = [], [], [], []
    batches = accelerator.skip_first_batches(dl, start) if start else dl
    step = start
    for x, y in batches:
        if step >= args.steps:
            break
        before = fp.comm_stats.snapshot()
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            comm.append({"sync": accelerator.sync_gradients, **grad_comm(before, fp.comm_stats.snapshot())})
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
        lrs.append(sched.get_last_lr()[0])
        step += 1
        counter.n = step
        if args.save_at and step == int(args.save_at[0]):
            accelerator.save_state(args.save_at[1])
    return {"losses": losses, "norms": norms, "comm": comm, "lrs": lrs, "start": start, "step": accelerator.step}


if __name__ == "__main__":
    main()
