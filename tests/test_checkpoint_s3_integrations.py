"""Integrations checkpointing to a bucket on a real S3 API (moto server, s3fs): Lightning's
``Trainer(default_root_dir="s3://...", strategy="fsdp_plugin")`` saves and resumes at another world size, its
keep-last-k rotation removes a checkpoint only after the next is published, ``state_dict_type="full"`` files;
accelerate ``save_state``/``load_state``; the transformers Trainer's ``output_dir`` and ``resume_from_checkpoint``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _s3 import S3Server, new_bucket

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch  # noqa: E402
from lightning_train import reference_run  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "hf_trainer_check.py"

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    s = S3Server().start()
    yield s
    s.stop()


@pytest.fixture
def bucket(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)  # the launched Trainer reads the endpoint like any s3fs client
    return new_bucket()


def test_lightning_default_root_dir_on_a_bucket_saves_and_resumes(bucket, tmp_path):
    import s3fs

    root = f"{bucket}/lightning"
    ckpt = f"{root}/mid/step4.ckpt"  # trainer.save_checkpoint after step 4 (mid-fit)
    launch.python("lightning_train.py", "--out", tmp_path / "a.json", "--devices", 2, "--max-steps", 4,
                  "--root-dir", root, "--save-at", 4, ckpt, timeout=300, cwd=tmp_path)
    fs = s3fs.S3FileSystem()
    assert fs.exists(f"{ckpt}/manifest.json")
    assert fs.exists(f"{root}/checkpoints/epoch=0-step=4.ckpt/manifest.json")  # the default ModelCheckpoint
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())  # no local "s3:" directory
    launch.python("lightning_train.py", "--out", tmp_path / "b.json", "--devices", 1, "--max-steps", 8,
                  "--resume", ckpt, timeout=300, cwd=tmp_path)
    got = launch.report(tmp_path / "b.json")["losses"]
    want, _ = reference_run(8)
    assert [e[0] for e in got] == [5, 6, 7, 8]
    assert max(abs(e[1] - w) for e, w in zip(got, want[4:])) <= 1e-5, (got, want[4:])


def test_lightning_full_checkpoint_on_a_bucket_saves_resumes_and_loads_with_lightning(bucket, tmp_path):
    """state_dict_type="full": one Lightning torch file, uploaded as one object; resumed at another world size,
    and read by Lightning's own ``load_from_checkpoint`` (fsspec) with ``weights_only=True``."""
    import s3fs
    import torch

    url = f"{bucket}/full/step4.ckpt"
    launch.python("lightning_train.py", "--out", tmp_path / "a.json", "--devices", 2, "--max-steps", 4,
                  "--state-dict-type", "full", "--save", url, timeout=300, cwd=tmp_path)
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert fs.isfile(url) and fs.cat(url, start=0, end=4) == b"PK\x03\x04"  # one object: a zip archive
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir())
    launch.python("lightning_train.py", "--out", tmp_path / "b.json", "--devices", 1, "--max-steps", 5,
                  "--state-dict-type", "full", "--resume", url, "--forbid-pickle", timeout=300, cwd=tmp_path)
    got = launch.report(tmp_path / "b.json")
    want, _ = reference_run(5)
    assert [e[0] for e in got["losses"]] == [5]
    assert abs(got["losses"][0][1] - want[4]) <= 1e-5, (got["losses"], want[4])  # the step-4 weights, exactly
    from lightning_train import Regressor

    loaded = Regressor.load_from_checkpoint(url, weights_only=True)  # Lightning's loader, through fsspec
    ref = reference_run(4)[1]
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, ref[k], atol=1e-5, rtol=1e-5)


def test_trainer_output_dir_on_a_bucket_saves_rotates_and_resumes(bucket, tmp_path):
    """transformers Trainer on fsdp_plugin (accelerate launch, 2 processes), output_dir="s3://...": every
    checkpoint-<step> folder is on the bucket (sharded state written by every rank, the Trainer's files uploaded),
    save_total_limit rotates it, and a new Trainer resumes from the URL exactly."""
    import json

    from test_hf_trainer import accelerate

    url = f"{bucket}/trainer"
    accelerate(SCRIPT, [tmp_path, "bucket", url])
    r = json.loads((tmp_path / "bucket_rank0.json").read_text())
    assert r["engine"] and len(r["hist"]["loss"]) == 9
    assert r["listing"] == ["checkpoint-6", "checkpoint-9"], r["listing"]  # checkpoint-3 rotated away
    files = set(r["ckpt6"])
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "fsdp_plugin_state/manifest.json"} <= files
    assert any(f.startswith("fsdp_plugin_state/") and f.endswith("rank00001.model.safetensors") for f in files)
    resumed = [v for s, v in zip(r["resumed"]["step"], r["resumed"]["loss"]) if s > 6]
    assert len(resumed) == 3 and max(abs(a - b) for a, b in zip(resumed, r["hist"]["loss"][6:])) <= 1e-5
    assert r["local_dirs"] == []  # no local "s3:" directory
    for names in (r["saved"], r["final"]):  # save_model() (output_dir) and save_model(url): on the bucket
        assert {"config.json", "model.safetensors"} <= set(names), names


@pytest.fixture
def server_log(monkeypatch):
    """What the server did, in order: ("put", key) for every object written in one PUT, ("del", key) for every
    object deleted (DeleteObject and each key of DeleteObjects)."""
    from moto.s3.models import S3Backend

    log, put, delete = [], S3Backend.put_object, S3Backend.delete_object

    def logged_put(self, bucket_name, key_name, *a, **k):
        out = put(self, bucket_name, key_name, *a, **k)
        log.append(("put", key_name))
        return out

    def logged_delete(self, bucket_name, key_name, *a, **k):
        log.append(("del", key_name))
        return delete(self, bucket_name, key_name, *a, **k)

    monkeypatch.setattr(S3Backend, "put_object", logged_put)
    monkeypatch.setattr(S3Backend, "delete_object", logged_delete)
    return log


def test_lightning_keep_last_k_on_a_bucket_removes_after_the_new_manifest(bucket, server_log, tmp_path):
    """ModelCheckpoint(save_top_k=2 of the highest steps, every step) with asynchronous saves: Lightning asks to
    remove step n-2 right after *starting* step n's save; the strategy removes it only once step n's manifest is
    published, and its manifest before its objects."""
    import s3fs

    root = f"{bucket}/lastk"
    launch.python("lightning_train.py", "--out", tmp_path / "a.json", "--devices", 2, "--max-steps", 4,
                  "--keep-last", 2, root, "--async-ckpt", timeout=300, cwd=tmp_path)
    assert launch.report(tmp_path / "a.json")["async_saves"] == 4  # one epoch of 4 steps
    prefix = root.split("/", 3)[3] + "/"
    log = [(op, k[len(prefix):]) for op, k in server_log if k.startswith(prefix)]
    published = {k.split("/")[0]: i for i, (op, k) in enumerate(log) if op == "put" and k.endswith("/manifest.json")}
    name = "epoch=0-step={}.ckpt".format
    assert sorted(published) == sorted(name(n) for n in range(1, 5)), log
    for old in (1, 2):
        dels = [i for i, (op, k) in enumerate(log) if op == "del" and k.startswith(name(old) + "/")]
        assert dels, (old, log)
        assert min(dels) > published[name(old + 2)], (old, log)  # evicted by step old+2: after it is published
        assert log[min(dels)] == ("del", f"{name(old)}/manifest.json"), log  # uncommitted first
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.ls(root)) == [name(3), name(4)]
    assert fp_latest(root) == f"{root}/{name(4)}"


def fp_latest(root: str):
    import fsdp_plugin as fp

    return fp.latest_checkpoint(root)


@pytest.fixture
def fresh_accelerate(monkeypatch):
    from accelerate.state import AcceleratorState, GradientState

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.setenv(name, "false" if name != "ACCELERATE_MIXED_PRECISION" else "no")
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_save_state_and_load_state_on_a_bucket(bucket, fresh_accelerate, tmp_path, monkeypatch):
    import s3fs
    import torch
    from torch import nn

    import fsdp_plugin as fp
    from fsdp_plugin.integrations.accelerate import Accelerator

    monkeypatch.chdir(tmp_path)
    acc = Accelerator(sharding_config=fp.ShardingConfig())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    sched.step()
    state = f"{bucket}/acc/step1"
    acc.save_state(state)
    names = sorted(k.rsplit("/", 1)[-1] for k in s3fs.S3FileSystem().ls(state))
    assert names == ["accelerator_state.json", "model_0", "rng_0.json", "rng_0.safetensors"], names
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sched.step()
    acc.load_state(state)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), expected[n]), n
    assert sched.get_last_lr() == [0.05]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(":")]
