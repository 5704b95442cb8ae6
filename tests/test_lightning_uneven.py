"""Lightning with uneven training batches per rank: each epoch runs inside torch's Join (``_uneven``).

Two ranks with 3 and 5 (or 4 and 6) batches, Lightning's launcher in a subprocess (``scripts/lightning_uneven.py``).
Reference: one process on the global data of each step, the exhausted rank's samples counting zero
(gradients divided by the world size, DDP + Join's default). Compared per step (each rank's loss), at the end
(weights, lr, global_step) and after the epoch: validation with ``sync_dist``, a second epoch, checkpoints.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch

pytest.importorskip("lightning")
import lightning_uneven as lu

pytestmark = pytest.mark.integration
TOL = 1e-5


def _run(tmp_path, *args) -> list:
    launch.python("lightning_uneven.py", tmp_path, *args, timeout=240)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check(reports, ref, accumulate: int) -> None:
    for rank, report in enumerate(reports):
        got = [loss * accumulate for loss in report["losses"]]  # Lightning reports loss / accumulate
        want = ref["losses"][rank]
        assert len(got) == len(want), (rank, got, want)
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL * max(1.0, max(want)), (rank, got, want)
        assert report["global_step"] == ref["steps"]           # the short rank counted the shadowed steps
        assert report["epoch"] == reports[0]["epoch"]
        assert report["lr"] == pytest.approx(ref["lr"], rel=1e-12)                # its scheduler followed
        assert report["val_loss"] == pytest.approx(ref["val_loss"], rel=TOL)
    weights = {k.removeprefix("net."): torch.tensor(v) for k, v in reports[0]["weights"].items()}
    assert weights.keys() == ref["weights"].keys()
    assert max((weights[k] - ref["weights"][k]).abs().max().item() for k in weights) <= TOL


def test_uneven_batches_shadowed_then_validation_second_epoch_and_checkpoints(tmp_path):
    ref = lu.reference()
    even = lu.reference((3, 3))  # the test can fail: the long rank's last two steps matter
    assert max((ref["weights"][k] - even["weights"][k]).abs().max().item() for k in ref["weights"]) > 1e-3
    assert ref["steps"] == 10
    _check(_run(tmp_path), ref, accumulate=1)
    # ModelCheckpoint names come from rank 0, the short rank: its global_step includes the shadowed steps
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt"]
    assert (tmp_path / "final.ckpt" / "manifest.json").is_file()


def test_uneven_validation_batches_run_inside_fp_join(tmp_path):
    """Validation with 1 batch on rank 0 and 3 on rank 1 after each epoch (``_uneven_eval``: fp.join): the
    short rank replays its last validation_step with its logs discarded, so the synced val_loss is the mean over
    the 4 real batches, as one process computes it; training goes on exactly."""
    ref = lu.reference(val_counts=(1, 3))
    assert ref["val_loss"] != pytest.approx(lu.reference()["val_loss"], rel=1e-3)   # the counts matter
    _check(_run(tmp_path, "--val-counts", 1, 3), ref, accumulate=1)


def test_uneven_iterable_dataset_with_gradient_accumulation_and_max_steps(tmp_path):
    """No ``__len__`` (Lightning prefetches to find the last batch), accumulate_grad_batches=2, and max_steps
    cutting the second epoch where the short rank's epoch ends: no rank validates there (the last ones to
    finish would not), the last validation is epoch 0's."""
    ref = lu.reference((4, 6), 2, max_steps=5)
    assert ref["steps"] == 5
    reports = _run(tmp_path, "--iterable", "--accumulate", 2, "--counts", 4, 6, "--max-steps", 5)
    _check(reports, ref, accumulate=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=3.ckpt", "epoch=1-step=5.ckpt"]
