"""A tiny LLaVA (CLIP vision tower + Llama, built from configs, nothing downloaded) whose images sit on some
ranks only, per step: rank 0 only, none, both, rank 1 only. With the tower declared in
``some_ranks_modules`` it trains like one process on the global batch (per-step loss within 1e-5), through
the plain API and through the transformers Trainer with the one-line import (issue 22)."""
from __future__ import annotations


import pytest
import torch

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import global_mean, make_optimizer

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
# Imported here, once: the forked ranks inherit them instead of importing them each (seconds on a busy box).
from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,  # noqa: E402
                          Trainer, TrainingArguments)

IMAGE, VOCAB, SEQ, PER_RANK, WORLD = 63, 64, 10, 2, 2
HAS_IMAGE = {0, 8, 11, 14}        # sample indices; sample i of step k is 4k + i, rank r holds 4k + 2r, 4k + 2r + 1
STEPS = 4


def tiny_llava():
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=8, patch_size=4)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE, image_seq_length=4,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg)


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, IMAGE, (SEQ,), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}     # every token a label: equal token counts per rank
    if i in HAS_IMAGE:
        ids[1:5] = IMAGE                                  # 2x2 patches: 4 image tokens
        out["labels"] = ids.clone()
        out["pixel_values"] = torch.randn(3, 8, 8, generator=g)
    return out


def collate(samples: list) -> dict:
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("input_ids", "labels")}
    pix = [s["pixel_values"] for s in samples if "pixel_values" in s]
    if pix:                                               # no images in this batch: the tower does not run
        batch["pixel_values"] = torch.stack(pix)
    return batch


def rank_batch(step: int, rank: int) -> dict:
    first = step * PER_RANK * WORLD + rank * PER_RANK
    return collate([sample(i) for i in range(first, first + PER_RANK)])


def reference_losses() -> list:
    model = tiny_llava()
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for s in range(STEPS):
        loss = model(**collate([sample(i) for i in range(4 * s, 4 * s + 4)])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _plain(rank, world):
    model = fp.shard(tiny_llava(), some_ranks_modules={"CLIPVisionModel"}, timeout_s=60)
    assert [u.fqn for u in model._fp_root.some_ranks_units] == ["model.vision_tower"]
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for s in range(STEPS):
        loss = model(**rank_batch(s, rank)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(global_mean(loss, world))
    return losses


def test_plain_api_llava_images_on_some_ranks():
    got = run_ranks(_plain, WORLD, timeout=120)[0]
    want = reference_losses()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def _default(rank, world):
    """Nothing declared: the LLaVA config's vision_config makes `model.vision_tower` a some-ranks unit."""
    model = fp.shard(tiny_llava(), timeout_s=60)
    assert [u.fqn for u in model._fp_root.some_ranks_units] == ["model.vision_tower"]
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for s in range(STEPS):
        loss = model(**rank_batch(s, rank)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(global_mean(loss, world))
    return losses


def test_plain_api_default_needs_no_declaration():
    got = run_ranks(_default, WORLD, timeout=120)[0]
    want = reference_losses()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def test_the_default_logs_its_cost_once(caplog):
    import logging

    from fsdp_plugin._build import some_ranks_default

    some_ranks_default._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_plugin"):
        fp.shard(tiny_llava())
        fp.shard(tiny_llava())
    lines = [r.getMessage() for r in caplog.records if "some ranks only" in r.getMessage()]
    assert len(lines) == 1 and "'model.vision_tower' (CLIPVisionModel)" in lines[0], lines
    assert "some_ranks_modules=()" in lines[0]


def test_plan_sees_the_default_like_the_declaration():
    """fp.plan discovers units with fp.shard's rule (LLaVA's forward itself cannot run on fake tensors)."""
    from fsdp_plugin.planner._units import discover_units

    def some(rule):
        units, _ = discover_units(tiny_llava(), None, (), None, rule)
        return [u.fqn for u in units if u.some_ranks]
    assert some(None) == some({"CLIPVisionModel"}) == ["model.vision_tower"]
    assert some(()) == []


def _undeclared(rank, world):
    model = fp.shard(tiny_llava(), some_ranks_modules=(), timeout_s=60)     # opted out of the default
    try:
        model(**rank_batch(0, rank)).loss.backward()
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_opted_out_tower_error_names_the_class_to_declare():
    msgs = run_ranks(_undeclared, WORLD, timeout=120)
    assert msgs[0] == msgs[1], msgs
    assert "'model.vision_tower' (CLIPVisionModel)" in msgs[0], msgs[0]
    assert "some_ranks_modules={'CLIPVisionModel'}" in msgs[0], msgs[0]


ENV = {"FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_SYNC_MODULE_STATES": "false", "FSDP_VERSION": "1",
       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer,CLIPEncoderLayer",
       "FSDP_RESHARD_AFTER_FORWARD": "full_shard", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
       "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "localhost", "MASTER_PORT": "0",
       "FSDP_PLUGIN_TIMEOUT_S": "60", "FSDP_PLUGIN_SOME_RANKS_MODULES": "CLIPVisionModel"}


def _trainer(rank, world, out_dir):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    import fsdp_plugin.integrations.transformers as integration

    integration.install()   # what the one-line import does in a fresh process (an earlier test may have undone it)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=PER_RANK * WORLD // world,
                             max_steps=STEPS, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             logging_steps=1, train_sampling_strategy="sequential", learning_rate=1e-3,
                             remove_unused_columns=False)
    trainer = Trainer(tiny_llava(), args, train_dataset=[sample(i) for i in range(4 * STEPS)], data_collator=collate)
    trainer.train()
    if world > 1:
        assert [u.fqn for u in trainer.model._fp_root.some_ranks_units] == ["model.vision_tower"]
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_default_needs_no_declaration(tmp_path):
    env = {k: v for k, v in ENV.items() if k != "FSDP_PLUGIN_SOME_RANKS_MODULES"}
    sharded = run_ranks(_trainer, WORLD, str(tmp_path / "fp"), timeout=180,
                        env={"ACCELERATE_USE_FSDP": "true", **env})[0]
    single = run_ranks(_trainer, 1, str(tmp_path / "one"), timeout=180,
                       env={"MASTER_ADDR": "localhost", "MASTER_PORT": "0"})[0]
    assert len(sharded) == len(single) == STEPS, (sharded, single)
    assert max(abs(a - b) for a, b in zip(sharded, single)) <= 1e-5, (sharded, single)


def test_trainer_llava_images_on_some_ranks(tmp_path):
    sharded = run_ranks(_trainer, WORLD, str(tmp_path / "fp"), timeout=180,
                        env={"ACCELERATE_USE_FSDP": "true", **ENV})[0]
    single = run_ranks(_trainer, 1, str(tmp_path / "one"), timeout=180,
                       env={"MASTER_ADDR": "localhost", "MASTER_PORT": "0"})[0]
    assert len(sharded) == len(single) == STEPS, (sharded, single)
    assert max(abs(a - b) for a, b in zip(sharded, single)) <= 1e-5, (sharded, single)


def test_accelerate_settings_carry_the_declared_classes(monkeypatch):
    """accelerate's config has no such key: FSDP_PLUGIN_SOME_RANKS_MODULES reaches ShardingConfig (env route
    and FullyShardedDataParallelPlugin route alike)."""
    from fsdp_plugin.integrations.accelerate.config.from_env import settings_from_env
    from fsdp_plugin.integrations.accelerate.config.resolve import sharding_config

    env = {"ACCELERATE_USE_FSDP": "true", **ENV}
    cfg = sharding_config(settings_from_env(env), tiny_llava())
    assert cfg.some_ranks_modules == ("CLIPVisionModel",)
    env.pop("FSDP_PLUGIN_SOME_RANKS_MODULES")
    assert sharding_config(settings_from_env(env), tiny_llava()).some_ranks_modules is None
    env["FSDP_PLUGIN_SOME_RANKS_MODULES"] = "none"        # opts out of the default
    assert sharding_config(settings_from_env(env), tiny_llava()).some_ranks_modules == ()
    env.pop("FSDP_PLUGIN_SOME_RANKS_MODULES")

    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_plugin.integrations.accelerate.config.from_plugin import settings_from_plugin

    monkeypatch.setenv("FSDP_PLUGIN_SOME_RANKS_MODULES", "CLIPVisionModel, LlavaMultiModalProjector")
    names = settings_from_plugin(FullyShardedDataParallelPlugin()).some_ranks_modules
    assert names == ("CLIPVisionModel", "LlavaMultiModalProjector")
