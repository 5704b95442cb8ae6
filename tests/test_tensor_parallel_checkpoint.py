"""Checkpoints across (dp, tp) changes (issue 31): a run saved at 2 dp x 2 tp resumes at 4 x 1 (no TP),
1 x 4, 1 x 2 and world 1, model and optimizer state bit-exact; the next step matches within 1e-5; the
manifest (version 2) stores TP pieces as boxes; consolidate and inspect read it."""
import json
import os

import pytest
import torch

from _dist import run_ranks
import _tp


def _equal(a: dict, b: dict, what: str):
    assert set(a) == set(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item():.3e}"


def _same_snapshot(got, want, layout):
    (state, moments, steps), (w_state, w_moments, w_steps) = got, want
    _equal(state, w_state, f"{layout} params")
    for k in w_moments:
        _equal(moments[k], w_moments[k], f"{layout} {k}")
    assert steps == w_steps


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    results = run_ranks(_tp.ckpt_worker, 4, "2x2", path, "save", timeout=240)
    return path, results[0]


def test_manifest_stores_tp_pieces_as_boxes(saved_2x2):
    path, _ = saved_2x2
    with open(os.path.join(path, "manifest.json")) as f:
        doc = json.load(f)
    assert doc["version"] == 2 and doc["sharding"]["tp_size"] == 2
    q = doc["params"]["blocks.0.attn.q.weight"]["pieces"]        # colwise: rows [0, 8) and [8, 16), dp-split
    assert all(isinstance(p[1], list) for p in q) and sum(p[2][0] for p in q) == 16
    down = doc["params"]["blocks.0.mlp.down.weight"]["pieces"]   # rowwise over the odd width: columns 9 | 8
    assert sorted({p[2][1] for p in down}) == [8, 9]
    bias = doc["params"]["blocks.0.attn.o.bias"]["pieces"]        # TP-replicated: written once (tp rank 0)
    assert bias and all(p[0] % 2 == 0 for p in bias)                 # ranks 0, 2 are tp coordinate 0


@pytest.mark.parametrize("layout", ["4x1", "1x4", "1x2", "1", "h1x2x2", "2x2"])
def test_resume_at_another_layout_is_exact(saved_2x2, layout):
    path, (want, want_loss) = saved_2x2
    world = _tp.LAYOUTS[layout][0]
    results = run_ranks(_tp.ckpt_worker, world, layout, path, "load", timeout=240)
    for snap, loss in results:
        _same_snapshot(snap, want, layout)
        assert abs(loss - want_loss) <= 1e-5, (layout, loss, want_loss)


def test_consolidate_and_inspect_read_boxes(saved_2x2, tmp_path):
    from safetensors.torch import load_file
    from fsdp_plugin.checkpoint.consolidate import consolidate
    from fsdp_plugin.checkpoint.tools import inspect_checkpoint, verify_checkpoint
    path, ((state, _, _), _) = saved_2x2
    consolidate(path, str(tmp_path / "out"))
    got = {}
    for f in os.listdir(tmp_path / "out"):
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "out" / f)))
    _equal(got, state, "consolidated")
    assert verify_checkpoint(path) == []
    assert inspect_checkpoint(path)["world_size"] == 4
