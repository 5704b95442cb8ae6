"""Accelerate config → fsdp_plugin translation (no processes launched).

The launcher's env is produced by accelerate's own code (``_validate_launch_command`` +
``prepare_multi_gpu_env``) from yaml text, so these tests cover what ``accelerate launch`` exports.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

import fsdp_plugin as fp
from fsdp_plugin.integrations.accelerate import AccelerateConfigError, settings_from_env
from fsdp_plugin.integrations.accelerate.config.resolve import sharding_kwargs

HEAD = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: '{mp}'
use_cpu: true
"""


def launcher_env(tmp_path, fsdp_config: str, mp: str = "no", extra: str = "") -> dict:
    """The env ``accelerate launch --config_file`` would export for this yaml."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "cfg.yaml"
    body = HEAD.format(mp=mp) + "fsdp_config:\n" + textwrap.indent(textwrap.dedent(fsdp_config), "  ") + extra
    path.write_text(body)
    args = launch_command_parser().parse_args(["--config_file", str(path), "script.py"])
    args, _, _ = _validate_launch_command(args)
    return {k: v for k, v in prepare_multi_gpu_env(args).items()
            if k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_"))}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


SAFE = "fsdp_cpu_ram_efficient_loading: false\nfsdp_sync_module_states: false\n"


def test_v1_reshard_name_wins_over_launcher_default(tmp_path):
    env = launcher_env(tmp_path, "fsdp_version: 1\nfsdp_reshard_after_forward: SHARD_GRAD_OP\n" + SAFE)
    assert env["FSDP_SHARDING_STRATEGY"] == "FULL_SHARD"  # the launcher's default, exported anyway
    assert settings_from_env(env).strategy == "shard_grad_op"


@pytest.mark.parametrize("value,expected", [("NO_SHARD", "no_shard"), ("HYBRID_SHARD", "hybrid_shard"),
                                            ("FULL_SHARD", "full_shard"), ("2", "shard_grad_op")])
def test_v1_strategy_names(tmp_path, value, expected):
    env = launcher_env(tmp_path, f"fsdp_version: 1\nfsdp_reshard_after_forward: {value}\n" + SAFE)
    assert settings_from_env(env).strategy == expected


def test_v1_legacy_sharding_strategy_key(tmp_path):
    env = launcher_env(tmp_path, "fsdp_version: 1\nfsdp_sharding_strategy: NO_SHARD\n" + SAFE)
    assert settings_from_env(env).strategy == "no_shard"


@pytest.mark.parametrize("value,expected", [("true", "full_shard"), ("false", "shard_grad_op")])
def test_v2_reshard_bool(tmp_path, value, expected):
    env = launcher_env(tmp_path, f"fsdp_version: 2\nfsdp_reshard_after_forward: {value}\n" + SAFE)
    assert settings_from_env(env).strategy == expected


def test_conflicting_v1_keys_fail_naming_both():
    env = {"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "shard_grad_op", "FSDP_SHARDING_STRATEGY": "NO_SHARD"}
    with pytest.raises(AccelerateConfigError, match="fsdp_reshard_after_forward.*fsdp_sharding_strategy"):
        settings_from_env(env)


@pytest.mark.parametrize("env,key", [
    ({"FSDP_RESHARD_AFTER_FORWARD": "HYBRID_SHARD_ZERO2"}, "fsdp_config.fsdp_reshard_after_forward"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"},
     "fsdp_config.fsdp_activation_checkpointing_offload"),
    ({"FSDP_AUTO_WRAP_POLICY": "LAYER_WRAP"}, "fsdp_config.fsdp_auto_wrap_policy"),
    ({"FSDP_BACKWARD_PREFETCH": "SOMETIMES"}, "fsdp_config.fsdp_backward_prefetch"),
    ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "mixed_precision"),
    ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"},
     "parallelism_config.parallelism_config_sp_size"),
])
def test_unsupported_values_name_the_yaml_key(env, key):
    with pytest.raises(AccelerateConfigError, match=key.replace(".", r"\.")):
        settings_from_env(dict(env, FSDP_VERSION="1"))


def test_flags_and_wrap_classes(tmp_path):
    env = launcher_env(tmp_path, textwrap.dedent("""\
        fsdp_version: 2
        fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
        fsdp_transformer_layer_cls_to_wrap: Block
        fsdp_offload_params: true
        fsdp_activation_checkpointing: true
        fsdp_state_dict_type: FULL_STATE_DICT
        fsdp_ignored_modules: head
        """) + SAFE, mp="bf16")
    s = settings_from_env(env)
    assert (s.cpu_offload, s.activation_checkpointing, s.state_dict_type) == (True, True, "full")
    kw = sharding_kwargs(s, Net())
    assert kw["auto_wrap_policy"] == {Block} and kw["activation_checkpointing"] == {Block}
    assert len(kw["ignored_modules"]) == 1 and isinstance(kw["ignored_modules"][0], nn.Linear)
    assert kw["mixed_precision"].param_dtype == torch.bfloat16
    assert kw["mixed_precision"].reduce_dtype == torch.float32


def test_unknown_wrap_class_fails_naming_key():
    s = settings_from_env({"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Nope"})
    with pytest.raises(AccelerateConfigError, match="fsdp_transformer_layer_cls_to_wrap.*Nope"):
        sharding_kwargs(s, Net())


def test_no_split_modules_fallback_and_size_policy():
    net = Net()
    net._no_split_modules = ["Block"]
    s = settings_from_env({"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"})
    assert sharding_kwargs(s, net)["auto_wrap_policy"] == {Block}
    s = settings_from_env({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "10"})
    assert sharding_kwargs(s, net)["auto_wrap_policy"].min_params == 10
    s = settings_from_env({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"})
    assert not any(sharding_kwargs(s, net)["auto_wrap_policy"](m) for m in net.modules())
    assert sharding_kwargs(settings_from_env({}), net)["auto_wrap_policy"] is None  # engine default


def test_parallelism_config_becomes_hybrid(tmp_path):
    extra = "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 1\n"
    env = launcher_env(tmp_path, "fsdp_version: 2\n" + SAFE, extra=extra)
    s = settings_from_env(env)
    assert (s.strategy, s.mesh) == ("hybrid_shard", (2, 1))
    with pytest.raises(AccelerateConfigError, match="fsdp_reshard_after_forward"):
        settings_from_env(dict(env, FSDP_RESHARD_AFTER_FORWARD="false"))


def test_parallelism_config_with_tp_keeps_accelerates_mesh(tmp_path):
    """tp_size > 1: no mesh of ours (accelerate's ParallelismConfig builds it from these variables), hybrid when
    dp_replicate > 1; cp stays refused."""
    extra = "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 2\n"
    env = launcher_env(tmp_path, "fsdp_version: 2\n" + SAFE, extra=extra)
    s = settings_from_env(env)
    assert (s.strategy, s.mesh, s.tensor_parallel) == ("full_shard", None, True)
    s = settings_from_env(dict(env, PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2"))
    assert (s.strategy, s.mesh, s.tensor_parallel) == ("hybrid_shard", None, True)
    assert not settings_from_env(dict(env, PARALLELISM_CONFIG_TP_SIZE="1")).tensor_parallel


def test_tp_parallelism_config_is_kept_for_stock_accelerate(monkeypatch):
    """With tp_size > 1 the ParallelismConfig stays in the arguments stock accelerate sees (it builds the mesh and
    splits the data); from the launcher's env it is accelerate's own ParallelismConfig() reading the variables.
    Without TP it is translated into our hybrid mesh and removed, as before."""
    from accelerate import ParallelismConfig
    from fsdp_plugin.integrations.accelerate.config.selection import select_settings

    env = {"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bound = {}
    s = select_settings(bound, None)
    pc = bound["parallelism_config"]
    assert s.tensor_parallel and s.mesh is None and (pc.dp_shard_size, pc.tp_size) == (2, 2)
    mine = ParallelismConfig(dp_shard_size=2, tp_size=2)
    bound = {"parallelism_config": mine}
    assert select_settings(bound, None).tensor_parallel and bound["parallelism_config"] is mine
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "1")
    bound = {"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=1)}
    s = select_settings(bound, None)
    assert "parallelism_config" not in bound and (s.mesh, s.strategy, s.tensor_parallel) == ((2, 2), "hybrid_shard",
                                                                                           False)


def test_shipped_example_yaml_is_accepted():
    from pathlib import Path

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    yaml = Path(__file__).resolve().parents[1] / "examples" / "accelerate_fsdp_cpu.yaml"
    args = launch_command_parser().parse_args(["--config_file", str(yaml), "script.py"])
    args, _, _ = _validate_launch_command(args)
    s = settings_from_env(prepare_multi_gpu_env(args))
    assert s.strategy == "full_shard" and s.wrap.class_names == ("Block",)


def test_plugin_object_translation():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_plugin.integrations.accelerate import settings_from_plugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=False, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"], cpu_ram_efficient_loading=False, state_dict_type="SHARDED_STATE_DICT")
    s = settings_from_plugin(plugin)
    assert s.strategy == "shard_grad_op"
    assert sharding_kwargs(s, Net())["auto_wrap_policy"] == {Block}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="NO_SHARD", sync_module_states=False,
                                            cpu_ram_efficient_loading=False, backward_prefetch="NO_PREFETCH")
    s = settings_from_plugin(plugin)
    assert (s.strategy, s.backward_prefetch) == ("no_shard", False)


def test_plugin_and_lightning_share_the_torch_fsdp_translator():
    """The plugin's torch objects go through the translator Lightning's FSDPStrategy arguments use."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_plugin.integrations.accelerate import settings_from_plugin
    from fsdp_plugin.integrations.lightning._fsdp_kwargs import translate
    from torch.distributed.fsdp import CPUOffload, MixedPrecision
    from torch.distributed.fsdp.wrap import CustomPolicy

    policy = CustomPolicy(lambda m: isinstance(m, Block))
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=False, cpu_ram_efficient_loading=False,
                                            auto_wrap_policy=policy, mixed_precision_policy=mp,
                                            cpu_offload=CPUOffload(offload_params=True))
    s = settings_from_plugin(plugin)
    ours = translate({"auto_wrap_policy": policy, "mixed_precision": mp, "cpu_offload": CPUOffload(True)})
    wrapped = sharding_kwargs(s, Net())["auto_wrap_policy"]
    assert [wrapped(m) for m in Net().modules()] == [ours["auto_wrap_policy"](m) for m in Net().modules()]
    assert any(isinstance(m, Block) and wrapped(m) for m in Net().modules())
    assert (s.param_dtype, s.reduce_dtype) == (ours["mixed_precision"].param_dtype, torch.float32)
    assert s.cpu_offload and ours["cpu_offload"]
    bad = FullyShardedDataParallelPlugin(fsdp_version=1, sync_module_states=False, cpu_ram_efficient_loading=False,
                                         mixed_precision_policy=MixedPrecision(param_dtype=torch.bfloat16,
                                                                               keep_low_precision_grads=True))
    with pytest.raises(AccelerateConfigError, match="mixed_precision_policy.*keep_low_precision_grads"):
        settings_from_plugin(bad)


def test_plugin_takes_a_checkpointing_policy_object():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_plugin.integrations.accelerate import settings_from_plugin

    for given, want in ((fp.Checkpointing(every=2, selective=True), fp.Checkpointing({Block}, 2, True)),
                        (fp.Checkpointing({Block}, selective=True), fp.Checkpointing({Block}, selective=True)),
                        (True, {Block})):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
            cpu_ram_efficient_loading=False, activation_checkpointing=given)
        assert sharding_kwargs(settings_from_plugin(plugin), Net())["activation_checkpointing"] == want


def test_plugin_and_lightning_pass_hpz_int_through():
    """FSDP2's ``reshard_after_forward=<int>`` (hpZ) reaches ShardingConfig as the same int."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from fsdp_plugin.integrations.accelerate import settings_from_plugin
    from fsdp_plugin.integrations.lightning._plumbing import sharding_config

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    plugin.reshard_after_forward = 8      # accelerate's __post_init__ refuses an int: set after it
    s = settings_from_plugin(plugin)
    kwargs = sharding_kwargs(s, Net())
    assert (kwargs["sharding_strategy"], kwargs["reshard_after_forward"]) == ("full_shard", 8)
    assert sharding_config({"reshard_after_forward": 4}).reshard_after_forward == 4
    from fsdp_plugin.integrations.accelerate.config.from_env import settings_from_env
    s = settings_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_PLUGIN_HPZ_SIZE": "2"})
    assert sharding_kwargs(s, Net())["reshard_after_forward"] == 2
    with pytest.raises(AccelerateConfigError, match="FSDP_PLUGIN_HPZ_SIZE"):
        settings_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_PLUGIN_HPZ_SIZE": "node"})
