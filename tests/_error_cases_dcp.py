"""The error catalogue's cases for DCP conversion and checkpoint directories (tests/test_error_catalog.py lists
them in CASES)."""
import os

import torch
from torch import nn

import fsdp_plugin as fp


class _ForeignPickle:
    def __reduce__(self):
        import os
        return os.system, ("echo pwned",)


def _dcp_dir(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"model": nn.Linear(2, 2).state_dict()}, checkpoint_id=path)  # no process group: one writer
    return path


def dcp_metadata_naming_a_foreign_global(tmp_path):
    import pickle

    path = _dcp_dir(tmp_path)
    with open(f"{path}/.metadata", "wb") as f:
        pickle.dump(_ForeignPickle(), f)
    fp.load_checkpoint(path, nn.Linear(2, 2))


def truncated_dcp_data_file(tmp_path):
    import os

    path = _dcp_dir(tmp_path)
    os.truncate(f"{path}/__0_0.distcp", 100)
    fp.load_checkpoint(path, nn.Linear(2, 2))


def dcp_save_interrupted(tmp_path):
    import os

    path = _dcp_dir(tmp_path)
    os.remove(f"{path}/.metadata")
    fp.load_checkpoint(path, nn.Linear(2, 2))


def dcp_optimizer_groups_differ(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp_path / "dcp"))
    swapped = torch.optim.AdamW([{"params": model[1].parameters()}, {"params": model[0].parameters()}])
    fp.load_checkpoint(str(tmp_path / "dcp"), model, swapped)


def export_dcp_onto_an_existing_directory(tmp_path):
    from fsdp_plugin.checkpoint.dcp import export_dcp

    fp.save_checkpoint(str(tmp_path / "ckpt"), nn.Linear(2, 2))
    (tmp_path / "out").mkdir()
    export_dcp(tmp_path / "ckpt", tmp_path / "out")


def load_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("x")
    fp.load_checkpoint(str(tmp_path / "runs"), nn.Linear(2, 2))


def load_an_interrupted_save(tmp_path):
    fp.save_checkpoint(str(tmp_path / "ckpt"), nn.Linear(2, 2))
    os.remove(tmp_path / "ckpt" / "manifest.json")
    fp.load_checkpoint(str(tmp_path / "ckpt"), nn.Linear(2, 2))
