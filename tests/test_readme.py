"""The README, followed as a newcomer follows it: every command it shows runs, and does what it says.

Commands are read from README.md (tests/_readme.py): a README edit changes what runs here, and a new
command without a check here fails ``test_every_readme_command_is_checked``. Launchers run in subprocesses
(fast variants: step counts / 10, see _readme.py); ``fsdp-plugin`` runs in-process on their outputs.
The torchrun pair (examples/train_gpt.py) is checked in tests/test_examples.py next to its uninterrupted twin.
"""
from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

import _readme
from _launch import run
from _readme import ROOT, argv, fast_steps, one, workdir
from fsdp_plugin.cli import main as cli

pytestmark = pytest.mark.integration

# Every README command, by the test that checks it (or why none runs it). A new command must be added here.
CHECKED = {
    r"^python3 -m venv|^\. \.venv|^pip install": "set-up: the suite runs in the environment it makes",
    r"^bash \.ci/run$|^python -m pytest": "the test suite itself",
    r"^python benchmarks/": "benchmarks: not part of the suite (README, Tests and benchmarks)",
    r"benchmarks/two_nodes/run\.py": "test_two_nodes.py::test_two_node_testbed_link_bytes_equal_comm_stats_inter_node_bytes",
    r"^torchrun --nnodes 2 .* train\.py$": "a template for two nodes and the user's own train.py",
    r"torchrun --rdzv-backend c10d .*--max-restarts 3 train\.py$":
        "the restart recipe's template: tests/test_restart.py runs it on tests/scripts/restart_train.py",
    r"examples/lightning_gpt\.py": "test_demo_pair_trains_then_resumes",
    r"accelerate_train\.py|^fsdp-plugin inspect /tmp/acc_state$": "test_accelerate_pair_trains_then_resumes",
    r"hf_trainer\.py --out runs/sft --max-steps|^fsdp-plugin inspect runs/sft/":
        "test_trainer_pair_trains_then_resumes",
    r"peft_lora\.py": "test_peft_lora_trains_the_adapter_only",
    r"hf_trainer\.py --fsdp-args": "test_trainer_fsdp_args_under_torchrun",
    r"^fsdp-plugin (inspect|verify|consolidate|export) CKPT": "test_checkpoint_tools_on_the_demo_checkpoint",
    r"^fsdp-plugin consolidate epoch=": "test_consolidate_lightning_loads_without_the_strategy",
    r"examples/train_gpt\.py --help": "test_train_gpt_help",
    r"examples/train_gpt\.py --steps": "test_examples.py::test_train_gpt_readme_pair_resumes_exactly",
}


def _launch(command: str, tmp: Path, extra: tuple = (), timeout: float = 420, launcher: tuple = ()) -> str:
    return run(argv(command, tmp, extra, launcher), timeout=timeout, cwd=workdir(tmp), env={"PYTHONPATH": str(ROOT)})


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_every_readme_command_is_checked():
    own = {name for name in globals() if name.startswith("test_")}
    for command in _readme.commands():
        owners = [v for k, v in CHECKED.items() if re.search(k, command)]
        assert len(owners) == 1, f"README command {command!r} is checked by {owners}: add it to CHECKED"
        where, _, name = owners[0].rpartition("::")
        if name.startswith("test_"):  # a real test: here, or in the file named before "::"
            source = (ROOT / "tests" / where).read_text() if where else ""
            defined = set(re.findall(r"^def (test_\w+)", source, re.M)) if where else own
            assert name in defined, owners[0]


def test_first_screen_has_two_setup_commands():
    first = _readme.readme_text().split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", first, re.S)
    assert len(blocks) == 2 and blocks[1].strip() == "bash .ci/run", blocks
    assert "examples/lightning_gpt.py" in blocks[0] and "--resume last" in blocks[0]


def test_plan_prints_what_the_readme_shows(capsys):
    (command, shown), = [t for t in _readme.transcripts() if t[0].startswith("fsdp-plugin plan ")]
    rc, out, _ = _cli(capsys, *argv(command, Path("/nonexistent")))
    assert rc == 0 and out.rstrip("\n") == shown  # the README's table is this command's output, exactly


def test_train_gpt_help(capsys, monkeypatch):
    words = argv(one(r"train_gpt\.py --help"), Path("/nonexistent"))
    monkeypatch.setattr(sys, "argv", words[1:])
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / words[1]), run_name="__main__")
    assert e.value.code == 0 and "--resume" in capsys.readouterr().out


# ---------------------------------------------------------------- the demo (Lightning), first screen
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Both demo commands, in order, in one directory (README: steps 40 then 80; here 4 then 8)."""
    tmp = tmp_path_factory.mktemp("demo")
    first, second = _readme.find(r"^python examples/lightning_gpt\.py")
    fast = ("--save-every", fast_steps(20), "--sample", fast_steps(120))  # the script's defaults, scaled too
    return tmp, _launch(first, tmp, fast), _launch(second, tmp, fast)


def test_demo_pair_trains_then_resumes(demo):
    tmp, first, second = demo
    assert "starting at step 0, training to step 4" in first and re.search(r"^step 4\b", first, re.M), first[-3000:]
    assert "resumed at step 4, training to step 8" in second, second[-3000:]
    assert re.search(r"^step 8\b", second, re.M) and "sample:" in second, second[-3000:]
    names = sorted(p.name for p in (tmp / "out" / "gpt").iterdir())
    assert names == ["epoch=0-step=8.ckpt", "last.ckpt"], names  # ModelCheckpoint keeps the newest (save_top_k=1)


def test_checkpoint_tools_on_the_demo_checkpoint(demo, capsys):
    tmp, _, _ = demo
    names = {"CKPT": tmp / "out" / "gpt" / "last.ckpt", "OUT": tmp / "hf_out", "OUT.ckpt": tmp / "hf_out.ckpt"}
    commands = [[str(names.get(w, w)) for w in argv(c, tmp)]
                for c in _readme.find(r"^fsdp-plugin (inspect|verify|consolidate|export) CKPT")]
    assert [c[0] for c in commands[:4]] == ["inspect", "verify", "consolidate", "consolidate"], commands
    assert {tuple(c) for c in commands[4:]} == {tuple(commands[4])} and commands[4][0] == "export", commands
    rc, out, err = _cli(capsys, *commands[0])
    assert rc == 0 and "saved by world size 2" in out and '"full_shard"' in out and "bytes on disk" in out, out + err
    assert "Lightning checkpoint: step 8, epoch 0, 1 optimizer" in out, out[:500]  # what the directory is
    assert '"global_step": 8' in out, out[-2000:]  # extra: Lightning's loop state at save
    rc, out, _ = _cli(capsys, *commands[1])
    assert rc == 0 and out.strip().endswith(": OK"), out
    rc, out, _ = _cli(capsys, *commands[2])
    from safetensors.torch import load_file
    weights = load_file(tmp / "hf_out" / "model.safetensors")
    assert rc == 0 and "gpt.blocks.0.qkv.weight" in weights and len(weights) == 53, sorted(weights)
    rc, out, _ = _cli(capsys, *commands[3])
    full = torch.load(tmp / "hf_out.ckpt", weights_only=True)
    assert rc == 0 and full["global_step"] == 8, full.keys()
    torch.testing.assert_close(full["state_dict"]["gpt.blocks.0.qkv.weight"], weights["gpt.blocks.0.qkv.weight"])
    export = [str(tmp / "dcp_out") if w == str(tmp / "hf_out") else w for w in commands[4]]
    rc, out, _ = _cli(capsys, *export)
    from fsdp_plugin.checkpoint.dcp.metadata import read_metadata
    from fsdp_plugin.checkpoint.format.layouts import detect
    entries = read_metadata(str(tmp / "dcp_out")).entries
    assert rc == 0 and detect(tmp / "dcp_out").kind == "dcp" and "model.gpt.blocks.0.qkv.weight" in entries, out


def test_consolidate_lightning_loads_without_the_strategy(demo, capsys):
    tmp, _, _ = demo
    names = {"epoch=3-step=400.ckpt": tmp / "out" / "gpt" / "epoch=0-step=8.ckpt", "model.ckpt": tmp / "model.ckpt"}
    rc, out, _ = _cli(capsys, *[names.get(w, w) for w in argv(one(r"^fsdp-plugin consolidate epoch="), tmp)])
    full = torch.load(tmp / "model.ckpt", weights_only=True)
    assert rc == 0 and "load_from_checkpoint" in out and full["global_step"] == 8, out
    assert full["hyper_parameters"]["max_steps"] == 8 and "gpt.head.weight" in full["state_dict"]


# ---------------------------------------------------------------- Accelerate
@pytest.fixture(scope="module")
def accelerate_pair(tmp_path_factory):
    """README: 20 steps with save_state, then resume to 40 (here 2, then 4)."""
    tmp = tmp_path_factory.mktemp("acc")
    first, second = _readme.find(r"accelerate_train\.py")
    return tmp, first, second, _launch(first, tmp), _launch(second, tmp)


def test_accelerate_pair_trains_then_resumes(accelerate_pair, capsys):
    tmp, _, _, first, second = accelerate_pair
    state = tmp / "acc_state"
    assert "trained steps 1..2" in first and f"saved state to {state} at step 2" in first, first[-3000:]
    assert (state / "model_0" / "manifest.json").is_file() and (state / "accelerator_state.json").is_file()
    assert f"resumed from {state} at step 2" in second and "trained steps 3..4" in second, second[-3000:]
    assert re.search(r"^step\s+4 ", second, re.M) and not re.search(r"^step\s+[12] ", second, re.M), second[-3000:]
    rc, out, _ = _cli(capsys, *argv(one(r"^fsdp-plugin inspect /tmp/acc_state"), tmp))
    # the state the first command saved: 2 optimizer steps of 2 micro-batches (the README's 20 steps: 40)
    assert rc == 0 and out.startswith("accelerate state: 1 model, 1 optimizer, accelerator.step 4"), out[:500]


def test_accelerate_resume_with_nothing_left_says_so(accelerate_pair):
    tmp, first, second, _, _ = accelerate_pair
    steps = re.search(r"--steps (\d+)", first).group(1)   # the first command's total: already reached
    # one process (the state was saved by two: it loads at any count), the cheaper launch
    out = _launch(second, tmp, ("--steps", fast_steps(int(steps))), launcher=("--num_processes", 1))
    assert "nothing left to train: the state is at step 2 and --steps 2 is the total" in out, out[-3000:]
    assert "trained steps" not in out


# ---------------------------------------------------------------- transformers Trainer, TRL, PEFT
@pytest.fixture(scope="module")
def trainer_pair(tmp_path_factory):
    """README: 20 steps (checkpoints every 10), then resume from checkpoint-20 to 30 (here 2, 1, 2, 3)."""
    tmp = tmp_path_factory.mktemp("sft")
    first, second = _readme.find(r"hf_trainer\.py --out runs/sft --max-steps")
    saved_last = re.search(r"--max-steps (\d+)", first).group(1)
    assert f"checkpoint-{saved_last}" in second  # it resumes from the last checkpoint the first one saved
    save = ("--save-steps", fast_steps(10))
    return tmp, _launch(first, tmp, save), _launch(second, tmp, save)


def test_trainer_pair_trains_then_resumes(trainer_pair, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    tmp, first, second = trainer_pair
    runs = tmp / "runs" / "sft"
    assert "sharded=True step 2 (started at 0)" in first, first[-3000:]
    assert "sharded=True step 3 (started at 2)" in second, second[-3000:]
    for step in (1, 2, 3):
        assert (runs / f"checkpoint-{step}" / "fsdp_plugin_state" / "manifest.json").is_file(), step
    assert json.loads((runs / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    monkeypatch.chdir(tmp)  # the README's relative runs/sft
    rc, out, _ = _cli(capsys, *argv(one(r"^fsdp-plugin inspect runs/sft/"), tmp))
    assert rc == 0 and out.startswith("Trainer checkpoint: step 2, model + 1 optimizer in fsdp_plugin_state/"), out
    model = AutoModelForCausalLM.from_pretrained(runs / "final")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_peft_lora_trains_the_adapter_only(tmp_path):
    from safetensors.torch import load_file

    out = _launch(one(r"peft_lora\.py"), tmp_path, ("--max-steps", fast_steps(20)))
    lora = tmp_path / "runs" / "lora"
    assert "sharded=True" in out and "frozen_grads=0" in out, out[-3000:]
    assert all("lora_" in k for k in load_file(lora / "adapter" / "adapter_model.safetensors"))
    diff = float(out.split("max |logits merged - adapter| = ")[1].split()[0])
    assert diff <= 1e-5 and (lora / "merged" / "model.safetensors").is_file()


def test_trainer_fsdp_args_under_torchrun(tmp_path):
    # --bf16 appended: this run also checks the README's "TRL SFTTrainer with bf16" (no extra launch)
    out = _launch(one(r"hf_trainer\.py --fsdp-args"), tmp_path, ("--max-steps", fast_steps(20), "--bf16"))
    assert "sharded=True step 2 (started at 0)" in out, out[-3000:]
    assert (tmp_path / "runs" / "sft2" / "final" / "config.json").is_file()
