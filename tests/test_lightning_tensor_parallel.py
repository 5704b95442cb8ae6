"""``FSDPPluginStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with Lightning's own launcher (world 4 on
CPU/gloo, issue 31): a LightningModule written for ModelParallelStrategy (``configure_model`` parallelizes on
``self.device_mesh["tensor_parallel"]``) trains like one plain process on the global batch, per step within 1e-5."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch  # noqa: E402

import _tp  # noqa: E402

pytestmark = pytest.mark.integration


def _sample(i: int):
    """Sample i of the script's dataset: row i % 4 of ``_tp.global_batch(i // 4)``."""
    idx, tgt = _tp.global_batch(i // 4)
    return idx[i % 4], tgt[i % 4]


def _reference(batches: list):
    """One plain process on the global batches (lists of sample indices): per step loss, final parameters."""
    torch.manual_seed(0)
    model = _tp.TPGPT()
    opt = _tp.make_optimizer("adamw", model.parameters())
    losses = []
    for ids in batches:
        idx, tgt = (torch.stack(t) for t in zip(*map(_sample, ids)))
        loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.reshape(-1)[:6].tolist() for k, v in model.state_dict().items()}


def test_model_parallel_strategy_code_matches_one_process(tmp_path):
    launch.python("lightning_tp.py", tmp_path, timeout=420)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert ranks[0]["mesh"] == ["data_parallel", "tensor_parallel"] and ranks[0]["module_mesh"]
    seen = [[i for i, _ in r["seen"]] for r in ranks]
    # sampler over dp ranks only: TP peers (2d, 2d+1) read the same samples, the two dp ranks split each batch
    assert seen[0] == seen[1] and seen[2] == seen[3] and len(seen[0]) == 3
    batches = [a + b for a, b in zip(seen[0], seen[2])]
    assert sorted(i for b in batches for i in b) == list(range(12))
    losses, params = _reference(batches)
    got = [(a[1] + b[1]) / 2 for a, b in zip(ranks[0]["seen"], ranks[2]["seen"])]
    assert max(abs(a - b) for a, b in zip(got, losses)) <= 1e-5, (got, losses)
    for r in ranks:
        assert sorted(r["params"]) == sorted(params)
        for k, v in params.items():
            assert max(abs(a - b) for a, b in zip(r["params"][k], v)) <= 1e-5, k
    assert (tmp_path / "final.ckpt" / "manifest.json").is_file()


def test_sizes_follow_model_parallel_strategy():
    """``"auto"``/unset: dp = nodes, tp = devices per node (ModelParallelStrategy's defaults); the product is checked."""
    import fsdp_plugin as fp
    from fsdp_plugin.integrations.lightning import _tensor_parallel as tp2d

    assert tp2d.resolve("auto", "auto", 1, 4) == (1, 4) and tp2d.resolve(2, None, 2, 4) == (2, 4)
    assert tp2d.resolve(2, 2, 1, 4) == (2, 2) and not tp2d.requested(None, None)
    with pytest.raises(fp.ConfigError, match="product is the world size"):
        tp2d.resolve(2, "auto", 1, 4)
