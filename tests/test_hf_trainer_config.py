"""How ``TrainingArguments(fsdp=..., fsdp_config=...)`` reaches fsdp_plugin (in this process, no launcher):
transformers builds accelerate's plugin from it, and our translation reads that plugin."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from fsdp_plugin.integrations.accelerate import settings_from_plugin


@pytest.fixture(autouse=True)
def restore_env(monkeypatch):
    """TrainingArguments and the plugin write FSDP_* / ACCELERATE_* variables and accelerate's singletons:
    restore them afterwards."""
    for name in ("FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_FSDP", "FSDP_STATE_DICT_TYPE",
                 "FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_SYNC_MODULE_STATES",
                 "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # TrainingArguments initialized accelerate's process state singletons
    GradientState._reset_state()


def settings_for(tmp_path, **fsdp_config):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config=fsdp_config, report_to=[],
                             use_cpu=True)
    return settings_from_plugin(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))


def test_transformers_defaults(tmp_path):
    s = settings_for(tmp_path)
    assert s.strategy == "full_shard" and s.state_dict_type == "full"  # transformers' default FULL_STATE_DICT
    assert s.wrap.kind == "transformer" and s.wrap.class_names is None  # → the model's _no_split_modules
    assert not s.cpu_ram_efficient_loading and not s.activation_checkpointing and not s.cpu_offload


def test_documented_keys_translate(tmp_path):
    s = settings_for(tmp_path, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=False,
                     state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=True,
                     activation_checkpointing=True, cpu_offload=True)
    assert s.wrap.class_names == ("LlamaDecoderLayer",) and s.strategy == "shard_grad_op"
    assert s.state_dict_type == "sharded" and s.cpu_ram_efficient_loading
    assert s.activation_checkpointing and s.cpu_offload


def test_fsdp1_names_translate(tmp_path):
    s = settings_for(tmp_path, version=1, reshard_after_forward="HYBRID_SHARD", backward_prefetch="backward_pre",
                     min_num_params=1000, auto_wrap_policy="SIZE_BASED_WRAP",
                     sync_module_states=False)  # v1 + sync needs an accelerator device in accelerate
    assert s.strategy == "hybrid_shard" and s.backward_prefetch and s.wrap.kind == "size"
    assert s.wrap.min_params == 1000
