"""Integrations checkpointing to a bucket on a real S3 API (moto server, s3fs): Lightning's
``Trainer(default_root_dir="s3://...", strategy="fsdp_plugin")`` saves and resumes at another world size."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _s3 import S3Server, new_bucket

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch  # noqa: E402
from lightning_train import reference_run  # noqa: E402

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
