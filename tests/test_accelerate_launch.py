"""Accelerate integration through the real ``accelerate launch`` (CPU, gloo, 1-2 processes).

Every launch runs a script in a subprocess with a clean environment in its own session; on timeout the
whole process group (launcher + ranks) is killed. The single-process reference is computed here.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from _launch import run

pytest.importorskip("accelerate")
import fsdp_plugin.checkpoint as ckpt

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "examples" / "accelerate_fsdp_cpu.yaml"
SCRIPT = ROOT / "tests" / "scripts" / "accelerate_train_check.py"
STEPS, SAVE_AT = 8, 4
needs_checkpoint = pytest.mark.skipif(not hasattr(ckpt, "save_checkpoint"),
                                      reason="fp.save_checkpoint/load_checkpoint not available yet")


def launch(script: Path, args: list, nproc: int = 2, config: Path = YAML, timeout: float = 150) -> str:
    """``accelerate launch`` ``script``; returns the output, raises with its tail on failure/timeout."""
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
           "--num_processes", str(nproc), "--main_process_port", "0", str(script), *map(str, args)]
    out = run(cmd, timeout=timeout, cwd=ROOT)
    assert "ACCELERATE_CHECK_DONE" in out, out[-6000:]
    return out


def reports(out_dir: Path, nproc: int) -> list[dict]:
    """Per-rank JSON reports written by the script."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def load_script():
    """The training script as a module (for the reference model, data and hyper-parameters)."""
    spec = importlib.util.spec_from_file_location("accelerate_train_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference(steps: int = STEPS):
    """Single process, plain torch, same global batches: (model, losses, clipped norms)."""
    mod = load_script()
    model, opt, sched = mod.build()
    dl = torch.utils.data.DataLoader(mod.dataset(), batch_size=mod.GLOBAL_BATCH, shuffle=False)
    losses, norms = [], []
    for i, (x, y) in enumerate(dl):
        if i >= steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss / mod.ACCUM).backward()
        losses.append(loss.item())
        if (i + 1) % mod.ACCUM == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            sched.step()
            opt.zero_grad()
    return model, losses, norms


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process run: 8 micro-steps, save_state after 4 (when available), save_model at the end."""
    tmp = tmp_path_factory.mktemp("acc")
    (tmp / "out").mkdir()
    args = [tmp / "out", "--steps", STEPS, "--save-model", tmp / "model"]
    if hasattr(ckpt, "save_checkpoint"):
        args += ["--save-at", SAVE_AT, tmp / "state"]
    launch(SCRIPT, args)
    return tmp, reports(tmp / "out", 2)


def test_really_our_engine_on_two_ranks(trained):
    _, (r0, r1) = trained
    assert {r0["process_index"], r1["process_index"]} == {0, 1}
    for r in (r0, r1):
        assert r["num_processes"] == r["pg_world"] == 2
        assert r["is_sharded"] and r["unwrap_is_model"] and r["opt_params_are_model_params"]
        assert r["state_type"] == "DistributedType.MULTI_CPU" and r["distributed_type"] == "DistributedType.FSDP"
        assert r["local_numel"] <= 0.55 * r["total_numel"]  # about half each (+ row padding: whole rows per rank)
        assert r["settings"]["sharding_strategy"] == r["strategy"] == "full_shard"
        assert r["settings"]["auto_wrap"] == r["wrap"] == ["Block"]
    assert r0["local_numel"] + r1["local_numel"] >= r0["total_numel"]
    assert r0["gathered"] == r1["gathered"] == [0, 1]  # gather_for_metrics still works


def test_loss_and_clipped_norm_match_single_process(trained):
    _, (r0, r1) = trained
    _, losses, norms = reference()
    assert r0["losses"] == r1["losses"] and r0["norms"] == r1["norms"]  # identical on every rank
    assert max(abs(a - b) for a, b in zip(r0["losses"], losses)) <= 1e-5, (r0["losses"], losses)
    assert len(r0["norms"]) == STEPS // 2 and min(norms) > 1.0  # clipping was active
    assert max(abs(a - b) / b for a, b in zip(r0["norms"], norms)) <= 1e-5, (r0["norms"], norms)


def test_no_gradient_communication_on_non_sync_micro_steps(trained):
    _, (r0, _) = trained
    for c in r0["comm"]:
        if c["sync"]:
            assert c["reduce_scatter"] > 0, c
        else:
            assert c["reduce_scatter"] == 0 and c["all_reduce"] == 0, c
    assert [c["sync"] for c in r0["comm"]] == [False, True] * (STEPS // 2)


def test_save_model_loads_into_plain_model(trained):
    from safetensors.torch import load_file

    tmp, (r0, _) = trained
    index = json.loads((tmp / "model" / "model.safetensors.index.json").read_text())
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(tmp / "model" / name))
    ref_model, _, _ = reference()
    plain = load_script().Net()
    plain.load_state_dict(state, strict=True)
    assert sorted(state) == r0["state_dict_keys"] == sorted(ref_model.state_dict())
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-5)


@needs_checkpoint
def test_state_dir_has_no_pickle_files(trained):
    tmp, _ = trained
    files = [p for p in (tmp / "state").rglob("*") if p.is_file()]
    assert files and not [p for p in files if p.suffix in (".bin", ".pkl", ".pt", ".pth")], files


@needs_checkpoint
@pytest.mark.parametrize("nproc", [2, 1])
def test_load_state_continues_exactly(trained, tmp_path, nproc):
    tmp, (r0, _) = trained
    launch(SCRIPT, [tmp_path, "--steps", STEPS, "--resume", tmp / "state", SAVE_AT], nproc=nproc)
    resumed = reports(tmp_path, nproc)[0]
    assert resumed["resumed_counter"] == SAVE_AT and resumed["start"] == SAVE_AT
    tol = 0.0 if nproc == 2 else 1e-5  # same world: bitwise; other world: reduction order differs
    assert max(abs(a - b) for a, b in zip(resumed["losses"], r0["losses"][SAVE_AT:])) <= tol
    assert max(abs(a - b) for a, b in zip(resumed["norms"], r0["norms"][SAVE_AT // 2:])) <= max(tol, 1e-5) * 10
    assert resumed["lrs"] == pytest.approx(r0["lrs"][SAVE_AT:], rel=1e-12)


HF_YAML = "".join(line for line in YAML.read_text().splitlines(keepends=True)
                  if "fsdp_transformer_layer_cls_to_wrap" not in line).replace(
    "fsdp_cpu_ram_efficient_loading: false", "fsdp_cpu_ram_efficient_loading: true").replace(
    "fsdp_sync_module_states: false", "fsdp_sync_module_states: true")


def test_hf_transformers_model_trains(tmp_path):
    pytest.importorskip("transformers")
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(HF_YAML)  # no class names: the model's _no_split_modules (GPT2Block) are wrapped
    assert "fsdp_transformer_layer_cls_to_wrap" not in HF_YAML
    launch(ROOT / "tests" / "scripts" / "accelerate_hf_check.py", [tmp_path], config=cfg, timeout=200)
    r0, r1 = reports(tmp_path, 2)
    assert r0["is_sharded"] and r0["wrap"] == ["GPT2Block"]
    assert (r0["loaded_on_meta"], r1["loaded_on_meta"]) == (False, True)  # rank 0 real, rank 1 meta
    assert r0["scatter_matches_rank0"], "rank 0's real weights did not reach the meta ranks"
    assert r0["losses"] == r1["losses"] and all(torch.isfinite(torch.tensor(r0["losses"])))
