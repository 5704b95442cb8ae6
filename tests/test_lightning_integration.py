"""Real multi-process Lightning Trainer / Fabric runs on CPU (gloo), each a subprocess script.

Lightning's launcher re-runs the command line for the other ranks, so nothing here starts a multi-device
Trainer inside pytest: ``scripts/lightning_launch.py`` runs the scripts with a clean environment and kills
the whole process group on timeout. References are plain single-process PyTorch on the same global batches
(``lightning_train.reference_run``), so parity is against PyTorch, not against another Lightning strategy.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch

pytest.importorskip("lightning")
import lightning_train as lt

pytestmark = pytest.mark.integration
TOL = 1e-5


def _losses(report: dict) -> list[float]:
    return [entry[1] for entry in report["losses"]]


def _close(got: list[float], want: list[float], tol: float = TOL) -> None:
    assert len(got) == len(want), (got, want)
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff <= tol * max(1.0, max(abs(w) for w in want)), f"max diff {diff}\n got {got}\nwant {want}"


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return lt.reference_run(8)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """2 ranks, Lightning's launcher, model built in configure_model (deferred init), 8 steps, ModelCheckpoint
    (top-1 + last, and every epoch) and a mid-fit ``trainer.save_checkpoint`` after step 4."""
    d = tmp_path_factory.mktemp("trainer")
    launch.python("lightning_train.py", "--out", d / "out.json", "--devices", 2, "--deferred",
                  "--ckpt-dir", d / "ck", "--save-at", 4, d / "step4.ckpt", timeout=240)
    return {"dir": d, "report": launch.report(d / "out.json")}


def test_two_ranks_deferred_init_match_single_process(trained, reference):
    report = trained["report"]
    assert report["strategy"] == "FSDPPluginStrategy" and report["world_size"] == 2
    assert report["precision_plugin"] == "FSDPPluginPrecision"
    _close(_losses(report), reference)


def test_model_checkpoint_writes_pickle_free_directories(trained):
    top, every = trained["dir"] / "ck" / "top", trained["dir"] / "ck" / "all"
    assert sorted(p.name for p in every.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    names = sorted(p.name for p in top.iterdir())
    assert len(names) == 2 and "last.ckpt" in names, names  # top-1 deleted the worse directory
    for ckpt in [*top.iterdir(), *every.iterdir(), trained["dir"] / "step4.ckpt"]:
        assert (ckpt / "manifest.json").is_file()
        assert all(f.suffix in (".json", ".safetensors") for f in ckpt.iterdir()), list(ckpt.iterdir())


def test_resume_on_one_device_continues_exactly(trained, reference):
    out = trained["dir"] / "resume1.json"
    launch.python("lightning_train.py", "--out", out, "--devices", 1, "--resume", trained["dir"] / "step4.ckpt",
                  "--forbid-pickle", timeout=180)
    report = launch.report(out)
    assert [e[0] for e in report["losses"]] == [5, 6, 7, 8] and report["world_size"] == 1
    _close(_losses(report), reference[4:])
    assert report["lr"] == pytest.approx(3e-3 * 0.25)  # StepLR restored


def test_resume_on_two_devices_with_torchrun(trained, reference):
    out = trained["dir"] / "resume2.json"
    launch.torchrun("lightning_train.py", "--out", out, "--devices", 2, "--resume", trained["dir"] / "step4.ckpt",
                    "--forbid-pickle", timeout=240)
    report = launch.report(out)
    assert report["launched_by"] == "torchrun" and report["world_size"] == 2
    _close(_losses(report), reference[4:])


@pytest.mark.slow
def test_async_checkpoints_and_compiled_model(tmp_path, reference):
    """AsyncCheckpointIO + a torch.compile'd LightningModule (per-unit, aot_eager): same losses, complete
    checkpoints, and the mid-fit one resumes exactly."""
    d = tmp_path
    launch.python("lightning_train.py", "--out", d / "out.json", "--devices", 2, "--async-ckpt",
                  "--compile", "aot_eager", "--ckpt-dir", d / "ck", "--save-at", 4, d / "step4.ckpt", timeout=600)
    report = launch.report(d / "out.json")
    _close(_losses(report), reference)
    assert report["compiled_units"] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"], report
    assert report["async_saves"] >= 3, report  # two epoch checkpoints, top-1/last, the mid-fit save
    for ckpt in [*(d / "ck" / "all").iterdir(), d / "step4.ckpt"]:
        assert (ckpt / "manifest.json").is_file(), ckpt
    launch.python("lightning_train.py", "--out", d / "resume.json", "--devices", 1, "--resume", d / "step4.ckpt",
                  "--forbid-pickle", timeout=240)
    _close(_losses(launch.report(d / "resume.json")), reference[4:])


def test_clip_norm_accumulate_init_module_full_checkpoint_validate(tmp_path):
    """trainer.init_module(empty_init=True) model, clip by norm + accumulation, a 'full' checkpoint, validate.

    The strategy gets Lightning FSDPStrategy's arguments as they are (torch enums, ModuleWrapPolicy, a
    transformer_auto_wrap_policy partial for activation checkpointing, CPUOffload, torch MixedPrecision,
    state_dict_type="full"; ``lightning_train.fsdp_strategy_kwargs``), and logs fp.comm_stats as metrics."""
    want, want_state = lt.reference_run(4, accumulate=2, clip=0.05)
    launch.python("lightning_train.py", "--out", tmp_path / "out.json", "--devices", 2, "--max-steps", 4,
                  "--accumulate", 2, "--clip-val", 0.05, "--fsdp-kwargs", "--init-module",
                  "--save", tmp_path / "full.ckpt", "--validate", timeout=240)
    report = launch.report(tmp_path / "out.json")
    _close(_losses(report), want)
    assert report["units"] == 4  # root + the three nn.Sequential blocks that ModuleWrapPolicy selected
    assert report["recomputed"] == 3  # activation_checkpointing_policy: the same three blocks
    comm = report["comm"]  # last optimizer step: 2 micro-batches x one reduce-scatter per unit, fp32, N=2
    assert comm["fsdp_plugin/comm_calls/reduce_scatter"] == 2 * 4
    from fsdp_plugin._flat.rows import row_aligned_offsets   # the units' flat lengths (row-aligned padding)
    net = lt.Net()
    units = [[net.stem.weight, net.stem.bias, net.head.weight, net.head.bias]] + [list(b.parameters()) for b in net.blocks]
    padded = sum(row_aligned_offsets([tuple(p.shape) for p in u], 2)[1] for u in units)
    assert abs(comm["fsdp_plugin/comm_bytes/reduce_scatter"] - 2 * padded * 4 / 2) <= 1
    assert comm["fsdp_plugin/comm_calls/all_gather"] >= 2 * 4
    x, y = lt.dataset().tensors
    reference_model = lt.Regressor()
    reference_model.load_state_dict(want_state)
    with torch.no_grad():
        _close([report["val_loss"]], [float(torch.nn.functional.mse_loss(reference_model(x), y))])
    # resume from the 'full' file on 1 device: weights and lr continue (Adam moments restart by design)
    launch.python("lightning_train.py", "--out", tmp_path / "resume.json", "--devices", 1, "--max-steps", 5,
                  "--accumulate", 2, "--clip-val", 0.05, "--resume", tmp_path / "full.ckpt", "--forbid-pickle",
                  timeout=180)
    resumed = launch.report(tmp_path / "resume.json")["losses"]
    _close([e[1] for e in resumed], lt.reference_run(5, accumulate=2, clip=0.05)[0][8:])
    assert [e[2] for e in resumed] == [3e-3 * 0.5] * 2
    # Lightning's own loader, no process group, torch's safe unpickler (weights_only=True)
    loaded = lt.Regressor.load_from_checkpoint(tmp_path / "full.ckpt", weights_only=True)
    assert dict(loaded.hparams) == {"deferred": False, "lr": 3e-3}
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, want_state[k], atol=1e-5, rtol=1e-5)
    raw = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert raw["global_step"] == 4 and set(raw["state_dict"]) == set(want_state)


def test_sharded_checkpoint_to_load_from_checkpoint_in_one_command(trained, tmp_path):
    """`fsdp-plugin consolidate CKPT OUT --format lightning`, then Lightning's loader with weights_only=True."""
    from fsdp_plugin.cli import main

    out = tmp_path / "model.ckpt"
    assert main(["consolidate", str(trained["dir"] / "step4.ckpt"), str(out), "--format", "lightning", "-q"]) == 0
    assert not torch.distributed.is_initialized()
    model = lt.Regressor.load_from_checkpoint(out, weights_only=True)
    assert dict(model.hparams) == {"deferred": True, "lr": 3e-3}  # configure_model built the net
    want = lt.reference_run(4)[1]
    assert set(model.state_dict()) == set(want)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, want[k], atol=1e-5, rtol=1e-5)
    raw = torch.load(out, weights_only=True)
    assert raw["global_step"] == 4 and "loops" in raw and "optimizer_states" not in raw
    assert main(["consolidate", str(trained["dir"] / "step4.ckpt"), str(tmp_path), "--format", "lightning"]) == 1


def test_trainer_test_on_one_device_from_two_device_sharded_checkpoint(trained, tmp_path):
    out = tmp_path / "test.json"
    launch.python("lightning_train.py", "--out", out, "--devices", 1, "--deferred", "--test",
                  trained["dir"] / "step4.ckpt", "--forbid-pickle", timeout=180)
    model = lt.Regressor()
    model.load_state_dict(lt.reference_run(4)[1])
    x, y = lt.dataset().tensors
    with torch.no_grad():
        want = float(torch.nn.functional.mse_loss(model(x), y))
    report = launch.report(out)
    assert report["world_size"] == 1
    _close([report["test_loss"]], [want])


def test_bf16_mixed_keeps_fp32_master_and_trains(tmp_path, reference):
    launch.python("lightning_train.py", "--out", tmp_path / "out.json", "--devices", 2, "--max-steps", 2,
                  "--precision", "bf16-mixed", timeout=180)
    report = launch.report(tmp_path / "out.json")
    assert report["param_dtype"] == "torch.bfloat16" and report["param_dtypes"] == ["torch.float32"]
    _close(_losses(report), reference[:2], tol=2e-2)


def test_fabric_deferred_init_accumulate_clip_save_load(tmp_path):
    launch.python("fabric_train.py", tmp_path / "out.json", tmp_path / "ckpt", 2, timeout=240)
    report = launch.report(tmp_path / "out.json")
    assert report["strategy"] == "FSDPPluginFabricStrategy" and report["world_size"] == 2
    _close(report["losses"], report["reference"])
    _close(report["resumed"], report["losses"][4:])
    assert report["step"] == 4 and report["note"] == ["tuple", float("inf")]
