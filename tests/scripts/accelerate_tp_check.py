"""accelerate ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` on fsdp_plugin (issue 31), driven by
tests/test_accelerate_tensor_parallel.py.

    accelerate launch --config_file CFG --num_processes 4 tests/scripts/accelerate_tp_check.py OUT train
    python tests/scripts/accelerate_tp_check.py OUT reference        # one plain process, the global batches

``train``: (1) an accelerate loop (the model's transformers tp_plan applied at prepare, AdamW built before
prepare, clipping) and (2) the transformers Trainer with ``TrainingArguments(parallelism_config=...)`` after the
one-line import; ``reference``: the same two on one process without FSDP. Writes ``OUT/<phase>_rank<r>.json``.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fsdp_plugin.integrations.transformers  # noqa: E402,F401  the Trainer's one-line change

import _tp  # noqa: E402  the tiny Llama of the engine's TP tests

STEPS, ROWS, DP, SEQ, CLIP = 3, 32, 2, 8, 0.5


def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 64, (ROWS, SEQ), generator=g)


def loop(accelerator=None) -> dict:
    """The accelerate loop: per step the rank's loss, its batch (first token ids) and the clipped norm."""
    model = _tp.llama()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6, weight_decay=0.1)
    dl = torch.utils.data.DataLoader(rows(), batch_size=(2 if accelerator else 2 * DP))
    if accelerator is not None:
        model, opt, dl = accelerator.prepare(model, opt, dl)
    out = {"loss": [], "norm": [], "batch": []}
    for step, ids in enumerate(dl):
        if step == STEPS:
            break
        loss = model(input_ids=ids, labels=ids).loss
        if accelerator is not None:
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
        else:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
        out["norm"].append(float(norm))
        out["batch"].append(ids[:, 0].tolist())
    state = accelerator.get_state_dict(model) if accelerator is not None else model.state_dict()
    out["params"] = {k: v.reshape(-1)[:6].tolist() for k, v in state.items()} if state else {}
    if accelerator is not None:
        import fsdp_plugin as fp

        # save_state / load_state of the 2-D model: TP boxes through accelerate's checkpoint API, bit-exact
        saved = {k: v.clone() for k, v in fp.full_state_dict(model, rank0_only=False).items()}
        accelerator.save_state(os.path.join(OUT, "acc_state"))
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        accelerator.load_state(os.path.join(OUT, "acc_state"))
        out["state_roundtrip"] = all(torch.equal(v, saved[k])
                                     for k, v in fp.full_state_dict(model, rank0_only=False).items())
        out["sharded"] = fp.is_sharded(model)
        out["dtensor_in_forward"] = _dtensor_names(model)
        out["opt_is_model"] = ({id(p) for g in opt.param_groups for p in g["params"]}
                               == {id(p) for p in model.parameters()})
    return out


def _dtensor_names(model) -> int:
    """How many parameters are DTensors inside fp.full_params (the TP boxes rebuilt with their specs)."""
    import fsdp_plugin as fp

    with fp.full_params(model):
        return sum(type(p).__name__ == "DTensor" for p in model.parameters())


def trainer(pc=None) -> dict:
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": r, "labels": r} for r in rows()]
    args = TrainingArguments(output_dir=os.path.join(OUT, f"trainer{'' if pc else '_ref'}"),
                             per_device_train_batch_size=2 if pc else 2 * DP, max_steps=STEPS, learning_rate=2e-3,
                             max_grad_norm=CLIP, logging_steps=1, save_strategy="steps" if pc else "no",
                             save_steps=STEPS, seed=0, report_to=[],
                             disable_tqdm=True, use_cpu=True, parallelism_config=pc)
    tr = Trainer(model=_tp.llama(), args=args, train_dataset=data)
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    ckpt = os.path.join(args.output_dir, f"checkpoint-{STEPS}", "fsdp_plugin_state", "manifest.json")
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "checkpoint": os.path.isfile(ckpt),
            "engine": bool(getattr(tr.accelerator, "_fp_active", False)),
            "tp_size": tr.get_tp_size(), "batch_total": tr.get_total_train_batch_size(args)}


def main() -> None:
    phase = sys.argv[2]
    if phase == "reference":
        rep = {"loop": loop(), "trainer": trainer()}
    else:
        from accelerate import ParallelismConfig
        from accelerate.state import AcceleratorState

        from fsdp_plugin.integrations.accelerate import Accelerator

        acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=DP, tp_size=2))
        rep = {"loop": loop(acc), "mesh": list(acc.torch_device_mesh.mesh_dim_names),
               "dp_mesh": list(acc._fp_dp_mesh.mesh_dim_names), "settings": acc.fsdp_settings.describe()}
        AcceleratorState._reset_state()       # the Trainer builds its own Accelerator (same process group)
        rep["trainer"] = trainer(ParallelismConfig(dp_shard_size=DP, tp_size=2))
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(OUT, f"{phase}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    print("ACCELERATE_CHECK_DONE", flush=True)


OUT = sys.argv[1] if __name__ == "__main__" else ""

if __name__ == "__main__":
    main()
