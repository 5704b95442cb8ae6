"""Source checkpoints written by torch's own FSDP2 + DCP (the baseline users migrate from), and the
reference losses of continuing that stock run. Test-only: imports torch FSDP/DCP."""
from __future__ import annotations

import torch
import torch.distributed as dist
from models import GPT

GLOBAL_BATCH, SEQ, VOCAB = 12, 16, 64
STEPS_BEFORE, STEPS_AFTER = 2, 3
LR = 3e-3


def batch(step, rank, world):
    """Rows of the global batch of ``step`` this rank trains on (the same data order at any world size)."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    rows = idx[rank * per:(rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def make_model(seed):
    torch.manual_seed(seed)
    return GPT(vocab=VOCAB, d=16, n_layer=2, seq=SEQ)


#: Parameters with weight decay: the matrices (by name: sharded parameters are 1-D pieces).
DECAY = frozenset(n for n, p in make_model(0).named_parameters() if p.dim() >= 2)


def groups(model, lr=LR):
    """Two param groups (weight decay on matrices only), AdamW: the usual LLM recipe."""
    decay = [p for n, p in model.named_parameters() if n in DECAY]
    rest = [p for n, p in model.named_parameters() if n not in DECAY]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def step(model, opt, i, rank, world, sched=None) -> float:
    x, y = batch(i, rank, world)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if sched is not None:
        sched.step()
    t = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= world
    return t.item()


def fsdp2_model(seed=0):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    return model


def full_state(model, opt) -> dict:
    """Every parameter and optimizer tensor in full (``fqn`` / ``fqn:key``), from DCP's state-dict API."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {k: v.clone() for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():  # empty off rank 0 (cpu_offload)
        out.update({f"{fqn}:{k}": v.clone() for k, v in st.items()})
    return out


def save_run(rank, world, path, layout="plain"):
    """Train STEPS_BEFORE steps with FSDP2, ``dcp.save``, keep training: the stock losses to match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = fsdp2_model()
    opt = groups(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9) if layout == "accelerate" else None
    for i in range(STEPS_BEFORE):
        step(model, opt, i, rank, world, sched)
    msd, osd = get_state_dict(model, opt)
    if layout == "plain":
        dcp.save({"model": msd, "optimizer": osd, "extra": {"step": STEPS_BEFORE, "name": "run"}}, checkpoint_id=path)
    elif layout == "accelerate":
        # accelerate's SHARDED_STATE_DICT, as its save_fsdp_model/optimizer write it (they need a GPU
        # distributed type to be selected, so the two DCP saves are made here); side files by its own code
        from accelerate.checkpointing import save_accelerator_state

        dcp.save({"model": msd}, checkpoint_id=f"{path}/pytorch_model_fsdp_0")
        dcp.save({"optimizer": osd}, checkpoint_id=f"{path}/optimizer_0")
        save_accelerator_state(path, [], [], [sched], [], rank, STEPS_BEFORE)
    state = full_state(model, opt)
    losses = [step(model, opt, STEPS_BEFORE + i, rank, world, sched) for i in range(STEPS_AFTER)]
    return losses, state if rank == 0 else None


def our_full_state(model, opt) -> dict:
    """Full params and optimizer tensors, assembled from every rank's pieces (all ranks return theirs)."""
    import fsdp_plugin as fp
    from fsdp_plugin._flat.layout import param_shards

    out = {k: v.clone() for k, v in fp.full_state_dict(model).items()}
    pieces = {}
    for sh in param_shards(model):
        for k, v in opt.state.get(sh.param, {}).items():
            pieces[f"{sh.fqn}:{k}"] = (sh.start, v.detach().clone().reshape(-1) if v.dim() else v.clone())
    return out, pieces


def assemble(per_rank, shapes) -> dict:
    full, _ = per_rank[0]
    out = dict(full)
    by_key: dict = {}
    for _, pieces in per_rank:
        for k, (start, v) in pieces.items():
            if v.dim() == 0:
                out[k] = v
            elif v.numel():
                by_key.setdefault(k, {})[start] = v
    for k, parts in by_key.items():
        out[k] = torch.cat([parts[s] for s in sorted(parts)]).view(shapes[k.split(":")[0]])
    return out
