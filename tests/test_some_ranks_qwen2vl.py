"""A tiny Qwen2-VL (its ``visual`` tower is a Qwen2VisionTransformer, built from configs, nothing downloaded)
with images on some ranks only per step, and nothing declared: the config's ``vision_config`` makes the tower a
some-ranks unit by default, and training matches one process on the global batch (per-step loss within 1e-5)."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _parity import global_mean, make_optimizer
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

import fsdp_plugin as fp

IMAGE, START, END, SEQ, PER_RANK, WORLD, STEPS = 60, 62, 63, 10, 2, 2, 4
HAS_IMAGE = {0, 8, 11, 14}        # sample i of step k is 4k + i; rank r holds 4k + 2r, 4k + 2r + 1


def tiny_qwen2vl():
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=61, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg)


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, IMAGE, (SEQ,), generator=g)
    out = {"input_ids": ids}
    if i in HAS_IMAGE:           # a 4x4-patch image merged 2x2: four image tokens
        ids[1], ids[2:6], ids[6] = START, IMAGE, END
        out["pixel_values"] = torch.randn(16, 3 * 2 * 2 * 2, generator=g)
    return out


def collate(samples: list) -> dict:
    ids = torch.stack([s["input_ids"] for s in samples])
    batch = {"input_ids": ids, "labels": ids.clone()}     # every token a label: equal token counts per rank
    pix = [s["pixel_values"] for s in samples if "pixel_values" in s]
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * len(pix))
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
    return batch


def _train(model, batches, world):
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(global_mean(loss, world) if world > 1 else loss.item())
    return losses


def rank_batches(rank: int) -> list:
    first = lambda s: s * PER_RANK * WORLD + rank * PER_RANK
    return [collate([sample(i) for i in range(first(s), first(s) + PER_RANK)]) for s in range(STEPS)]


def reference_losses() -> list:
    return _train(tiny_qwen2vl(), [collate([sample(i) for i in range(4 * s, 4 * s + 4)]) for s in range(STEPS)], 1)


def _sharded(rank, world):
    model = fp.shard(tiny_qwen2vl(), timeout_s=60)
    assert [u.fqn for u in model._fp_root.some_ranks_units] == ["model.visual"]
    return _train(model, rank_batches(rank), world)


def test_qwen2vl_images_on_some_ranks_with_nothing_declared():
    got = run_ranks(_sharded, WORLD, timeout=120)[0]
    want = reference_losses()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.integration
def test_lightning_with_nothing_declared(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import lightning_launch as launch

    launch.python("lightning_vlm.py", tmp_path, timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["units"] == ["net.model.visual"] for r in reports), reports
    got = [sum(r["losses"][s] for r in reports) / WORLD for s in range(STEPS)]
    want = reference_losses()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
