"""transformers Trainer / PEFT LoRA on fsdp_plugin, driven by tests/test_hf_trainer.py.

    accelerate launch --config_file CFG tests/scripts/hf_trainer_check.py OUT PHASE [CHECKPOINT]
    python tests/scripts/hf_trainer_check.py OUT reference        # plain single process, no FSDP

Phases: ``stock_fsdp`` (plain single process, checkpoints in the stock FSDP SHARDED_STATE_DICT layout), ``train`` (6 steps, GA 2, clipping, gradient checkpointing, save_steps 3, save_model, then a second
Trainer resuming from checkpoint-3), ``resume`` (from CHECKPOINT), ``lora`` (PEFT LoRA under torchrun with
FSDP set in TrainingArguments: adapter-only training and saves), ``reference`` (the plain single-process
twins of ``train`` and ``lora``; bf16 is exercised by examples/hf_trainer.py).
Each writes ``OUT/<phase>_rank<r>.json``.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import fsdp_plugin.integrations.transformers  # the one-line change

import fsdp_plugin as fp

GLOBAL_BATCH, SEQ, SAMPLES, STEPS = 4, 16, 48, 6


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      attention_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world(), gradient_accumulation_steps=2,
                max_steps=STEPS, learning_rate=1e-2, max_grad_norm=0.05, weight_decay=0.01, logging_steps=1,
                save_strategy="steps", save_steps=3, seed=0, report_to=[], disable_tqdm=True,
                gradient_checkpointing=True, use_cpu=True)
    base.update(kw)
    return TrainingArguments(**base)


def trainer(model, out: str, eval_dataset=None, **kw):
    from transformers import Trainer

    return Trainer(model=model, args=args(out, **kw), train_dataset=dataset(), eval_dataset=eval_dataset)


def history(tr) -> dict:
    logs = [h for h in tr.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "lr": [h["learning_rate"] for h in logs], "step": [h["step"] for h in logs]}


def numels(model) -> dict:
    return {"local": sum(p.numel() for p in model.parameters()),
            "full": sum(p.numel() for p in tiny_llama().parameters()), "sharded": fp.is_sharded(model)}


def phase_train(out: str) -> dict:
    tr = trainer(tiny_llama(), out)
    tr.train()
    tr.save_model(os.path.join(out, "final"))
    full = fp.full_state_dict(tr.model)  # collective
    exact = None
    if full:
        from transformers import LlamaForCausalLM

        loaded = LlamaForCausalLM.from_pretrained(os.path.join(out, "final")).state_dict()
        exact = sorted(loaded) == sorted(full) and all(torch.equal(loaded[k], v) for k, v in full.items())
    rep = {"hist": history(tr), "numel": numels(tr.model), "engine": bool(tr.accelerator._fp_active),
           "final_exact": exact, "ckpt3": sorted(os.listdir(os.path.join(out, "checkpoint-3")))}
    tr2 = trainer(tiny_llama(), os.path.join(out, "resumed"))
    tr2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))
    rep["resumed"] = history(tr2)
    return rep


def phase_resume(out: str, checkpoint: str) -> dict:
    """Also evaluates at each save and reloads the best checkpoint at the end (no training after it)."""
    tr = trainer(tiny_llama(), out, eval_dataset=dataset()[:8], eval_strategy="steps", eval_steps=3,
                 load_best_model_at_end=True, metric_for_best_model="loss")
    tr.train(resume_from_checkpoint=checkpoint)
    evals = [h["eval_loss"] for h in tr.state.log_history if "eval_loss" in h]
    return {"resumed": history(tr), "engine": bool(tr.accelerator._fp_active), "evals": evals,
            "best": os.path.basename(tr.state.best_model_checkpoint or ""), "eval_after_best": tr.evaluate()["eval_loss"]}


def phase_bucket(out: str, url: str) -> dict:
    """output_dir on a bucket: 9 steps, a checkpoint every 3 (the last 2 kept), then a new Trainer resumes from the
    URL of checkpoint-6 (its own output_dir on the bucket too)."""
    import fsspec

    tr = trainer(tiny_llama(), url, max_steps=9, save_total_limit=2)
    tr.train()
    rep = {"hist": history(tr), "engine": bool(tr.accelerator._fp_active)}
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    rep["listing"] = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root))
    rep["ckpt6"] = sorted(p[len(root) + len("/checkpoint-6/"):] for p in fs.find(root + "/checkpoint-6"))
    tr.save_model()  # output_dir: the bucket
    tr.save_model(url + "/final")
    fs.invalidate_cache()
    rep["saved"] = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root) if fs.isfile(p))
    rep["final"] = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root + "/final"))
    tr2 = trainer(tiny_llama(), url + "/resumed", max_steps=9)
    tr2.train(resume_from_checkpoint=url + "/checkpoint-6")
    rep["resumed"] = history(tr2)
    rep["local_dirs"] = sorted(n for n in os.listdir(".") if n.endswith(":"))
    return rep


def lora_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def phase_lora(out: str) -> dict:
    """Launched by torchrun: FSDP selected in TrainingArguments (FULL_STATE_DICT, save_only_model)."""
    model = lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    tr = trainer(model, out, max_steps=4, save_steps=4, gradient_checkpointing=False, fsdp=True,
                 fsdp_config={"state_dict_type": "FULL_STATE_DICT"}, save_only_model=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    tr.train()
    full = fp.full_state_dict(model)  # collective; rank 0 holds the full tensors
    frozen_same = all(torch.equal(full[n], t) for n, t in before.items()) if full else None
    no_frozen_grad = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    opt_params = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    only_adapter_in_opt = opt_params == {id(p) for n, p in model.named_parameters() if n in trainable}
    model.save_pretrained(os.path.join(out, "adapter"))        # collective on a sharded PEFT model
    tr.save_model(os.path.join(out, "trainer_adapter"))
    return {"hist": history(tr), "frozen_same": frozen_same, "no_frozen_grad": no_frozen_grad,
            "only_adapter_in_opt": only_adapter_in_opt, "engine": bool(tr.accelerator._fp_active),
            "sharded": fp.is_sharded(model), "files": sorted(os.listdir(os.path.join(out, "adapter"))),
            "trainer_files": sorted(os.listdir(os.path.join(out, "trainer_adapter"))),
            "ckpt4": sorted(os.listdir(os.path.join(out, "checkpoint-4"))),
            "ckpt4_optimizers": len(json.load(open(os.path.join(out, "checkpoint-4", "fsdp_plugin_state",
                                                               "manifest.json"))).get("optimizers") or [])}


def qlora_model(out: str):
    """tiny_llama written by save_pretrained (per rank: no shared-directory race) and loaded in 4-bit nf4."""
    from peft import LoraConfig, get_peft_model
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    base = os.path.join(out, f"base{os.environ.get('RANK', '0')}")
    tiny_llama().save_pretrained(base)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                           bnb_4bit_quant_storage=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))


def phase_qlora(out: str) -> dict:
    """The FSDP-QLoRA recipe (4-bit base, LoRA, Trainer with FSDP); torchrun: sharded, else one process."""
    model = qlora_model(out)
    fsdp = {"fsdp": True, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}} if world() > 1 else {}
    tr = trainer(model, os.path.join(out, "run"), max_steps=4, save_strategy="no", gradient_checkpointing=False,
                 **fsdp)
    tr.train()
    model.save_pretrained(os.path.join(out, "qlora_adapter"))
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    return {"hist": history(tr), "sharded": fp.is_sharded(model), "params4bit": len(packed),
            "packed_bytes": sum(p.numel() * p.element_size() for p in packed),
            "files": sorted(os.listdir(os.path.join(out, "qlora_adapter")))}


def phase_reference(out: str) -> dict:
    """Plain single-process twins (no process group, stock Trainer path)."""
    tr = trainer(tiny_llama(), os.path.join(out, "full"), save_strategy="no")
    tr.train()
    tr.model.save_pretrained(os.path.join(out, "ref_final"))
    lora = trainer(lora_model(), os.path.join(out, "lora"), max_steps=4, save_strategy="no",
                   gradient_checkpointing=False)
    lora.train()
    lora.model.save_pretrained(os.path.join(out, "ref_adapter"))
    return {"hist": history(tr), "lora": history(lora), "engine": bool(getattr(tr.accelerator, "_fp_active", 0))}


def _stock_fsdp_layout_callback():
    """At every save, replace the stock checkpoint's model.safetensors + optimizer.pt by what a stock FSDP
    ``SHARDED_STATE_DICT`` Trainer writes instead (accelerate's ``save_fsdp_model/optimizer``: torch DCP of
    ``{"model": ...}`` in ``pytorch_model_fsdp_0/`` and ``{"optimizer": ...}`` in ``optimizer_0/``). A stock
    FSDP Trainer needs a GPU; on CPU the same layout is written here from the plain run's state."""
    from transformers import TrainerCallback

    class StockFSDPLayout(TrainerCallback):
        def on_save(self, targs, state, control, model=None, optimizer=None, **kw):
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            ck = os.path.join(targs.output_dir, f"checkpoint-{state.global_step}")
            msd, osd = get_state_dict(model, getattr(optimizer, "optimizer", optimizer))
            dcp.save({"model": msd}, checkpoint_id=os.path.join(ck, "pytorch_model_fsdp_0"))
            dcp.save({"optimizer": osd}, checkpoint_id=os.path.join(ck, "optimizer_0"))
            for name in ("model.safetensors", "optimizer.pt", "config.json", "generation_config.json",
                         "training_args.bin"):  # a SHARDED_STATE_DICT save_model writes none of them
                os.remove(os.path.join(ck, name))

    return StockFSDPLayout()


def phase_stock_fsdp(out: str) -> dict:
    """Plain single-process stock Trainer (no fsdp_plugin engine), checkpoints in the stock FSDP layout."""
    tr = trainer(tiny_llama(), out)
    tr.add_callback(_stock_fsdp_layout_callback())
    tr.train()
    return {"hist": history(tr), "engine": bool(getattr(tr.accelerator, "_fp_active", 0)),
            "ckpt3": sorted(os.listdir(os.path.join(out, "checkpoint-3")))}


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    rep = {"train": lambda: phase_train(out), "resume": lambda: phase_resume(out, sys.argv[3]),
           "lora": lambda: phase_lora(out), "qlora": lambda: phase_qlora(out), "bucket": lambda: phase_bucket(out, sys.argv[3]), "stock_fsdp": lambda: phase_stock_fsdp(out),
           "reference": lambda: phase_reference(out)}[phase]()
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"{phase}_rank{rank}.json"), "w") as f:
        json.dump(rep, f)
    print("HF_TRAINER_CHECK_DONE", flush=True)


if __name__ == "__main__":
    main()
