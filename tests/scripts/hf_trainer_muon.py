"""transformers Trainer with Muon + AdamW (fp.optim.MuonWithAdamW) on fsdp_plugin, driven by
tests/test_hf_trainer_muon.py.

    accelerate launch --config_file CFG tests/scripts/hf_trainer_muon.py OUT train
    python tests/scripts/hf_trainer_muon.py OUT reference        # plain single process, no FSDP

``train``: a ``create_optimizer`` override (the README recipe), 6 steps (GA 2, clipping, save_steps 3), a second
Trainer resuming from checkpoint-3, and a third given ``optimizers=(MuonWithAdamW(...), None)``. ``reference``:
the same two routes in one plain process (stock Trainer path, full tensors). Each writes OUT/<phase>_rank<r>.json.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_trainer_check as base  # noqa: E402  (imports fsdp_plugin.integrations.transformers: the one line)

import fsdp_plugin as fp  # noqa: E402


def muon_groups(model, muon_lr: float = 0.02, adamw_lr: float = 1e-2, weight_decay: float = 0.01) -> list:
    """The README recipe: hidden 2-D matrices (by full shape and name) to Muon, the rest to AdamW."""
    def hidden(name, p):
        return len(fp.param_info(p).shape) == 2 and not any(k in name for k in ("embed", "lm_head"))

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if hidden(n, p)], "use_muon": True, "lr": muon_lr,
             "weight_decay": weight_decay, "adjust_lr_fn": "match_rms_adamw"},
            {"params": [p for n, p in named if not hidden(n, p)], "use_muon": False, "lr": adamw_lr,
             "weight_decay": weight_decay}]


def muon_trainer_class():
    from transformers import Trainer

    class MuonTrainer(Trainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = fp.optim.MuonWithAdamW(muon_groups(model if model is not None else self.model))
            return self.optimizer

    return MuonTrainer


def trainer(out: str, passed: bool = False, **kw):
    from transformers import Trainer

    model = base.tiny_llama()
    args = base.args(out, gradient_checkpointing=False, **kw)
    if passed:   # the Trainer(optimizers=...) route: built before the Trainer (and before fp.shard)
        return Trainer(model=model, args=args, train_dataset=base.dataset(),
                       optimizers=(fp.optim.MuonWithAdamW(muon_groups(model)), None))
    return muon_trainer_class()(model=model, args=args, train_dataset=base.dataset())


def routed(tr) -> dict:
    opt = getattr(tr.optimizer, "optimizer", tr.optimizer)
    return {"muon": sum(len(g["params"]) for g in opt.muon.param_groups),
            "adamw": sum(len(g["params"]) for g in opt.adamw.param_groups)}


def phase_train(out: str) -> dict:
    tr = trainer(out)
    tr.train()
    rep = {"hist": base.history(tr), "engine": bool(tr.accelerator._fp_active), "routed": routed(tr),
           "exchanges": fp.comm_stats.calls.get("optim_exchange", 0),
           "ckpt3": sorted(os.listdir(os.path.join(out, "checkpoint-3"))),
           "split": sorted(fp.param_info(p).fqn for p in tr.model.parameters() if fp.param_info(p).split)}
    tr2 = trainer(os.path.join(out, "resumed"))
    tr2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    rep["resumed"] = base.history(tr2)
    tr3 = trainer(os.path.join(out, "passed"), passed=True, max_steps=3, save_strategy="no")
    tr3.train()
    rep["passed"] = base.history(tr3)
    return rep


def phase_reference(out: str) -> dict:
    tr = trainer(os.path.join(out, "full"), save_strategy="no")
    tr.train()
    tr3 = trainer(os.path.join(out, "passed"), passed=True, max_steps=3, save_strategy="no")
    tr3.train()
    return {"hist": base.history(tr), "passed": base.history(tr3), "routed": routed(tr),
            "engine": bool(getattr(tr.accelerator, "_fp_active", 0))}


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    rep = {"train": phase_train, "reference": phase_reference}[phase](out)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"{phase}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    print("HF_TRAINER_MUON_DONE", flush=True)


if __name__ == "__main__":
    main()
