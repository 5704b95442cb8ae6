"""Every directory layout fsdp_plugin writes is recognised (fsdp_plugin.checkpoint.format.layouts) by
``fp.load_checkpoint`` and ``fsdp-plugin inspect/verify/consolidate``, described as what it is; "interrupted"
is said only with evidence. Layouts are written by the integrations' own writers, in this process (world 1).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.checkpoint.format import layouts
from fsdp_plugin.cli import main as cli


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _trained():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _accelerate_state(root) -> str:
    pytest.importorskip("accelerate")
    from fsdp_plugin.integrations.accelerate.state.blob import write_blob
    from fsdp_plugin.integrations.accelerate.state.io import FORMAT, STATE_NAME, save_models

    model, opt = _trained()
    path = os.path.join(root, "acc_state")
    os.makedirs(path)
    save_models(path, [model], [opt])
    write_blob(path, STATE_NAME, {"format": FORMAT, "step": 40, "num_processes": 1, "schedulers": [],
                                  "dataloaders": [], "scaler": None, "custom": []})
    return path


def _trainer_checkpoint(root) -> str:
    pytest.importorskip("transformers")
    from fsdp_plugin.integrations.transformers._checkpoint import state_dir

    model, opt = _trained()
    path = os.path.join(root, "runs", "checkpoint-20")
    fp.save_checkpoint(state_dir(path), model, opt, extra={"lr_scheduler": {"last_epoch": 20}})
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 20, "log_history": []}, f)
    return path


def _lightning_dir(root) -> str:
    from fsdp_plugin.integrations.lightning.checkpoint.io import EXTRA_KEY

    model, opt = _trained()
    path = os.path.join(root, "epoch=0-step=40.ckpt")
    fp.save_checkpoint(path, model, opt, extra={EXTRA_KEY: {"epoch": 0, "global_step": 40}})
    return path


def _dcp_dir(root) -> str:
    import torch.distributed.checkpoint as dcp  # a baseline writer: tests only

    path = os.path.join(root, "dcp")
    dcp.save({"model": _model().state_dict()}, checkpoint_id=path)
    return path


@pytest.mark.parametrize("write,summary,inner", [
    (_accelerate_state, "accelerate state: 1 model, 1 optimizer, accelerator.step 40", "model_0"),
    (_trainer_checkpoint, "Trainer checkpoint: step 20, model + 1 optimizer in fsdp_plugin_state/",
     "fsdp_plugin_state"),
    (_lightning_dir, "Lightning checkpoint: step 40, epoch 0, 1 optimizer, saved by world size 1", ""),
])
def test_trainer_layouts_are_read_by_every_tool(tmp_path, capsys, write, summary, inner):
    path = write(tmp_path)
    layout = layouts.detect(path)
    assert layout.summary.startswith(summary), layout.summary
    assert layouts.checkpoint_dir(path) == os.path.join(path, inner) if inner else path
    fresh = _model()
    fp.load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))
    torch.testing.assert_close(fresh[0].weight, _trained()[0][0].weight)
    assert cli(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert summary in out or layout.kind == "lightning", out
    assert "0.weight: F32   [6, 4]" in out and "optimizer 0: torch.optim.adamw.AdamW" in out, out
    assert cli(["verify", "-q", path]) == 0 and capsys.readouterr().out.strip().endswith(": OK")
    assert cli(["consolidate", "-q", path, str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_our_directory_says_its_step(tmp_path):
    model, opt = _trained()
    fp.save_checkpoint(tmp_path / "ck", model, opt, extra={"step": 200})
    assert layouts.detect(tmp_path / "ck").summary == ("fsdp_plugin checkpoint: 4 parameters, 1 optimizer, "
                                                       "saved by world size 1, step 200")


def test_dcp_is_described_with_what_reads_it(tmp_path, capsys):
    path = _dcp_dir(tmp_path)
    layout = layouts.detect(path)
    assert layout.kind == "dcp" and layout.summary.startswith("torch distributed checkpoint (DCP): .metadata + ")
    assert cli(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "torch distributed checkpoint (DCP)" in out and "fp.load_checkpoint" in out, out
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fp.load_checkpoint(path, model)   # the DCP reader: what inspect says reads it does
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), _model().state_dict().values()))
    assert cli(["verify", path]) == 1 and "interrupted" not in capsys.readouterr().err


def test_lightning_full_file_is_described(tmp_path, capsys):
    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": _model().state_dict(), "global_step": 3}, path)
    assert cli(["inspect", str(path)]) == 0
    assert "load_from_checkpoint" in capsys.readouterr().out


def test_trainer_output_dir_names_its_checkpoints(tmp_path):
    _trainer_checkpoint(tmp_path)
    with pytest.raises(fp.CheckpointError, match=r"1 checkpoint folder \(checkpoint-20\): give one of them"):
        fp.load_checkpoint(tmp_path / "runs", _model())


def test_foreign_directory_is_not_called_interrupted(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(fp.CheckpointError) as e:
        fp.load_checkpoint(tmp_path / "notes", _model())
    assert "interrupted" not in str(e.value) and "holds 1 entry (a.txt): not an fsdp_plugin checkpoint" in str(e.value)
    assert not isinstance(e.value, fp.IncompleteCheckpointError)
    assert cli(["inspect", str(tmp_path / "notes")]) == 1 and "interrupted" not in capsys.readouterr().err


def test_interrupted_only_with_evidence(tmp_path):
    model, opt = _trained()
    fp.save_checkpoint(tmp_path / "ck", model, opt)
    os.remove(tmp_path / "ck" / "manifest.json")  # rank files without the manifest a save writes last
    with pytest.raises(fp.IncompleteCheckpointError, match="rank files but no manifest.json"):
        fp.load_checkpoint(tmp_path / "ck", _model())
    (tmp_path / "empty").mkdir()
    (tmp_path / ("empty.tmp-" + "a" * 32)).mkdir()  # the temporary sibling of a save that did not finish
    with pytest.raises(fp.IncompleteCheckpointError, match=r"empty\.tmp-a{32} is left by a save that did not"):
        fp.load_checkpoint(tmp_path / "empty", _model())
