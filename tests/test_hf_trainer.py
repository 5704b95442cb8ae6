"""transformers Trainer, TRL SFTTrainer and PEFT LoRA on fsdp_plugin, through real launchers (CPU, gloo).

One plain single-process run (stock Trainer path, no process group) is the reference; the sharded runs
are ``accelerate launch`` (accelerate config route) and ``torchrun`` (TrainingArguments ``fsdp`` route).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from _launch import run, torchrun

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_trainer_check.py"
YAML = ROOT / "examples" / "accelerate_fsdp_trainer_cpu.yaml"
TOL = 1e-5


def accelerate(script: Path, args: list, nproc: int = 2, timeout: float = 240) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(YAML),
           "--num_processes", str(nproc), "--main_process_port", "0", str(script), *map(str, args)]
    return run(cmd, timeout=timeout, cwd=ROOT)


def report(out: Path, phase: str, rank: int = 0) -> dict:
    return json.loads((out / f"{phase}_rank{rank}.json").read_text())


def close(a: list, b: list, tol: float = TOL) -> float:
    assert len(a) == len(b), (a, b)
    diff = max(abs(x - y) for x, y in zip(a, b))
    assert diff <= tol, (diff, a, b)
    return diff


def after(hist: dict, step: int, key: str = "loss") -> list:
    return [v for s, v in zip(hist["step"], hist[key]) if s > step]


def check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_trainer_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """The plain single-process twins: full fine-tuning and LoRA."""
    out = tmp_path_factory.mktemp("reference")
    run([sys.executable, str(SCRIPT), out, "reference"], timeout=180, cwd=ROOT)
    assert report(out, "reference")["engine"] is False
    return out


def test_trainer_sharded_parity_checkpoints_resume(ref, tmp_path):
    """accelerate config route, 2 processes: sharded, per-step parity (GA 2, clipping, gradient
    checkpointing), sharded checkpoints, resume at 2 and at 1 process (with evaluation and
    load_best_model_at_end), save_model → from_pretrained."""
    from transformers import LlamaForCausalLM

    accelerate(SCRIPT, [tmp_path, "train"])
    r0, r1, base = report(tmp_path, "train", 0), report(tmp_path, "train", 1), report(ref, "reference")
    assert r0["engine"] and r0["numel"]["sharded"]
    for r in (r0, r1):  # each rank holds about half of the parameters
        assert abs(r["numel"]["local"] / r["numel"]["full"] - 0.5) < 0.02, r["numel"]
    close(r0["hist"]["loss"], base["hist"]["loss"])
    close(r0["hist"]["grad_norm"], base["hist"]["grad_norm"])  # pre-clip norms (~0.8 > max_grad_norm 0.05)
    assert r0["hist"]["lr"] == pytest.approx(base["hist"]["lr"], rel=1e-12)
    assert "fsdp_plugin_state" in r0["ckpt3"] and "trainer_state.json" in r0["ckpt3"]
    assert not {"optimizer.pt", "scheduler.pt", "model.safetensors"} & set(r0["ckpt3"])  # SHARDED_STATE_DICT
    state = tmp_path / "checkpoint-3" / "fsdp_plugin_state"
    assert {p.suffix for p in state.iterdir()} <= {".json", ".safetensors"}, sorted(state.iterdir())
    close(after(r0["resumed"], 3), r0["hist"]["loss"][3:])  # resumed at 2 processes
    assert r0["final_exact"] is True  # from_pretrained(save_model dir) == the sharded model, bit for bit
    final = LlamaForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    twin = LlamaForCausalLM.from_pretrained(ref / "ref_final").state_dict()
    assert sorted(final) == sorted(twin)
    assert max((final[k] - twin[k]).abs().max().item() for k in final) <= TOL
    one = tmp_path / "one"
    one.mkdir()
    accelerate(SCRIPT, [one, "resume", tmp_path / "checkpoint-3"], nproc=1)
    r = report(one, "resume")
    assert r["engine"]
    close(after(r["resumed"], 3), r0["hist"]["loss"][3:])  # resumed at 1 process
    assert r["best"] == "checkpoint-6"  # load_best_model_at_end reloaded it from the sharded state
    assert abs(r["eval_after_best"] - r["evals"][-1]) <= TOL


def test_peft_lora_sharded(ref, tmp_path):
    """TrainingArguments(fsdp=...) route under torchrun: only the adapter trains, parity, adapter-only
    saves (model.save_pretrained and trainer.save_model) that PeftModel loads, merge after consolidation."""
    from peft import PeftModel

    out = run(torchrun("--standalone", "--nproc_per_node=2", SCRIPT, tmp_path, "lora"), timeout=240, cwd=ROOT)
    assert "HF_TRAINER_CHECK_DONE" in out
    r, base = report(tmp_path, "lora"), report(ref, "reference")
    assert r["engine"] and r["sharded"]
    assert r["frozen_same"] and r["no_frozen_grad"] and r["only_adapter_in_opt"]
    close(r["hist"]["loss"], base["lora"]["loss"])
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(r["files"]) <= set(r["trainer_files"])
    assert not {"model.safetensors", "pytorch_model.bin"} & set(r["files"] + r["trainer_files"])
    assert {"fsdp_plugin_state", "adapter_model.safetensors"} <= set(r["ckpt4"])  # FULL_STATE_DICT adds HF files
    assert r["ckpt4_optimizers"] == 0 and "optimizer.pt" not in r["ckpt4"]  # save_only_model: weights only
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors").keys()
    assert keys and all("lora_" in k for k in keys)
    mod = check_module()
    ids = torch.arange(32).reshape(2, 16) % 64
    outs = {}
    for name in ("adapter", "trainer_adapter"):
        model = PeftModel.from_pretrained(mod.tiny_llama(), tmp_path / name).eval()
        outs[name] = model(input_ids=ids).logits
    twin = PeftModel.from_pretrained(mod.tiny_llama(), ref / "ref_adapter").eval()
    assert torch.equal(outs["adapter"], outs["trainer_adapter"])
    assert (outs["adapter"] - twin(input_ids=ids).logits).abs().max().item() <= TOL
    merged = PeftModel.from_pretrained(mod.tiny_llama(), tmp_path / "adapter").merge_and_unload().eval()
    assert (merged(input_ids=ids).logits - outs["adapter"]).abs().max().item() <= TOL


# examples/hf_trainer.py (bf16 included) and examples/peft_lora.py run as the README shows them: tests/test_readme.py
