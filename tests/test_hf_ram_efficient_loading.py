"""``fsdp_cpu_ram_efficient_loading``: with the transformers integration, ``from_pretrained`` reads weights
on rank 0 only; the other ranks build on meta, and sharding scatters rank 0's values (buffers too).
``save_pretrained`` on the sharded model (collective) writes what ``from_pretrained`` reads back exactly."""
from __future__ import annotations

import sys

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp

pytest.importorskip("transformers")


def _save_tiny(path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _ranks(rank, world, path):
    from transformers import LlamaForCausalLM

    import fsdp_plugin.integrations.transformers as integration

    integration.install()  # explicit: another test in this pytest process may have uninstalled it before the fork

    model = LlamaForCausalLM.from_pretrained(path)
    on_meta = all(p.is_meta for p in model.parameters())
    has_map = hasattr(model, "hf_device_map")
    fp.shard(model)
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(path + "-resaved")  # collective on a sharded model; rank 0 writes
    return on_meta, has_map, {k: v.clone() for k, v in fp.full_state_dict(model).items()}, logits


def test_only_rank0_reads_weights_and_scatter_restores_them(tmp_path):
    want = _save_tiny(tmp_path / "pre")
    res = run_ranks(_ranks, 2, str(tmp_path / "pre"), env={"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    assert (res[0][0], res[1][0]) == (False, True)  # rank 0 real, rank 1 meta
    assert not res[1][1]  # no stray hf_device_map (it would look like model parallelism)
    got = res[0][2]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(res[0][3], res[1][3])  # same outputs on both ranks (rotary buffers included)
    from transformers import LlamaForCausalLM

    resaved = LlamaForCausalLM.from_pretrained(tmp_path / "pre-resaved").state_dict()
    assert sorted(resaved) == sorted(want) and all(torch.equal(resaved[k], want[k]) for k in want)


def test_flag_off_or_rank0_or_single_process_loads_normally():
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations._hf_loading import ram_efficient_loading_requested as req

    integration.uninstall()  # importing installed the patches in this (pytest) process: undo
    assert not integration.is_installed()

    on = {"FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "WORLD_SIZE": "2"}
    assert req({**on, "RANK": "1"})
    assert not req({**on, "RANK": "0"})
    assert not req({**on, "RANK": "1", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"})
    assert not req({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "WORLD_SIZE": "1", "RANK": "0"})


def test_accelerate_flag_patches_from_pretrained_only(monkeypatch):
    """The Accelerator's ``cpu_ram_efficient_loading`` installs the loading hook without patching the Trainer."""
    pytest.importorskip("accelerate")
    import transformers
    from fsdp_plugin.integrations import _hf_loading
    from fsdp_plugin.integrations.accelerate.accelerator import _enable_ram_efficient_loading

    integration = sys.modules.get("fsdp_plugin.integrations.transformers")
    if integration is not None:  # another test in this process imported (installed) it
        integration.uninstall()
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # restored after the test
    _enable_ram_efficient_loading()
    try:
        patched = transformers.PreTrainedModel.__dict__["from_pretrained"]
        assert patched is not _hf_loading._ORIGINAL[0]
        trainer = transformers.Trainer
        assert not any(getattr(v, "__fsdp_plugin__", False) for v in vars(trainer).values())
        assert not getattr(transformers.PreTrainedModel.save_pretrained, "__fsdp_plugin__", False)
    finally:
        _hf_loading.uninstall()
