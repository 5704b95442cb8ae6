"""Lightning ``FSDPStrategy`` keyword arguments are translated into ``fp.ShardingConfig`` (or refused with our
equivalent named). In-process: no Trainer, no process group. The baselines are torch's own policy objects."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

import fsdp_plugin as fp
from fsdp_plugin._build.wrap import recompute_selector
from fsdp_plugin.integrations.lightning._plumbing import sharding_config
from fsdp_plugin.integrations.lightning._fsdp_kwargs import translate

pytest.importorskip("lightning")


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 1))


@pytest.mark.parametrize("value, want", [
    (ShardingStrategy.FULL_SHARD, "full_shard"), (ShardingStrategy.SHARD_GRAD_OP, "shard_grad_op"),
    (ShardingStrategy.NO_SHARD, "no_shard"), (ShardingStrategy.HYBRID_SHARD, "hybrid_shard"),
    ("FULL_SHARD", "full_shard"), ("SHARD_GRAD_OP", "shard_grad_op"), ("no_shard", "no_shard"),
])
def test_sharding_strategy_enum_or_string(value, want):
    assert sharding_config({"sharding_strategy": value}).sharding_strategy == want


def test_hybrid_zero2_refused_naming_ours():
    with pytest.raises(fp.ConfigError, match="'hybrid_shard'"):
        translate({"sharding_strategy": ShardingStrategy._HYBRID_SHARD_ZERO2})


def test_cpu_offload_prefetch_and_flags():
    cfg = sharding_config({"cpu_offload": CPUOffload(offload_params=True), "use_orig_params": True,
                           "backward_prefetch": BackwardPrefetch.BACKWARD_POST, "limit_all_gathers": False,
                           "forward_prefetch": True, "sync_module_states": True})
    assert cfg.cpu_offload is True and cfg.backward_prefetch is True and cfg.limit_all_gathers is False
    assert cfg.forward_prefetch is True
    assert sharding_config({"cpu_offload": CPUOffload()}).cpu_offload is False
    assert sharding_config({"backward_prefetch": None}).backward_prefetch is False
    with pytest.raises(fp.ConfigError, match="use_orig_params=True"):
        translate({"use_orig_params": False})
    with pytest.raises(fp.ConfigError, match="ignored_modules"):
        translate({"ignored_states": []})


def test_torch_mixed_precision_becomes_ours():
    mp = sharding_config({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                            buffer_dtype=torch.bfloat16)}).mixed_precision
    # FSDP1 keeps its `_module_classes_to_ignore` (default: BatchNorm) out of mixed precision: our fp32 modules
    assert mp == fp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   buffer_dtype=torch.bfloat16, cast_forward_inputs=True,
                                   fp32_modules=(torch.nn.modules.batchnorm._BatchNorm,))
    ours = fp.MixedPrecision(param_dtype=torch.float16)
    assert sharding_config({"mixed_precision": ours}).mixed_precision is ours
    with pytest.raises(fp.ConfigError, match="keep_low_precision_grads"):
        translate({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)})


@pytest.mark.parametrize("policy", [
    {Block}, ModuleWrapPolicy({Block}), functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
])
def test_class_policies_select_the_same_units(policy):
    cfg = sharding_config({"auto_wrap_policy": policy, "activation_checkpointing_policy": policy})
    assert cfg.auto_wrap_policy == {Block} and cfg.activation_checkpointing == {Block}


def test_size_policy_matches_torch_selection():
    cfg = sharding_config({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=100)})
    assert cfg.auto_wrap_policy.min_params == 100
    assert sharding_config({"auto_wrap_policy": size_based_auto_wrap_policy}).auto_wrap_policy.min_params == 10 ** 8
    # activation checkpointing: the engine's size selection, torch's bottom-up rule (as for auto-wrap);
    # each Block holds 144 parameters, the Linears 40 and 9
    policy = translate({"activation_checkpointing_policy":
                        functools.partial(size_based_auto_wrap_policy, min_num_params=100)})["activation_checkpointing"]
    assert policy.min_params == 100
    net = _net()
    select = recompute_selector(net, policy)
    assert [type(m).__name__ for m in net.children() if select(m)] == ["Block", "Block"]
    with pytest.raises(fp.ConfigError, match="fp.size_policy"):
        translate({"auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=1,
                                                         force_leaf_modules={Block})})


def test_callable_policies():
    lam = translate({"auto_wrap_policy": functools.partial(lambda_auto_wrap_policy,
                                                           lambda_fn=lambda m: isinstance(m, Block))})
    custom = translate({"auto_wrap_policy": CustomPolicy(lambda m: isinstance(m, Block))})

    def torch_style(module, recurse, nonwrapped_numel):
        return isinstance(module, Block)

    def ours(module):
        return isinstance(module, Block)

    torchy = translate({"auto_wrap_policy": torch_style})
    assert translate({"auto_wrap_policy": ours})["auto_wrap_policy"] is ours
    for cfg in (lam, custom, torchy):
        assert [type(m).__name__ for m in _net().children() if cfg["auto_wrap_policy"](m)] == ["Block", "Block"]
    with pytest.raises(fp.ConfigError, match="transformer_layer_cls"):
        translate({"auto_wrap_policy": transformer_auto_wrap_policy})
    with pytest.raises(fp.ConfigError, match="one ShardingConfig"):
        translate({"auto_wrap_policy": CustomPolicy(lambda m: {"sharding_strategy": "x"})})["auto_wrap_policy"](Block())


def test_deprecated_activation_checkpointing_classes_and_conflict():
    assert translate({"activation_checkpointing": Block})["activation_checkpointing"] == {Block}
    assert translate({"activation_checkpointing": [Block]})["activation_checkpointing"] == {Block}
    with pytest.raises(fp.ConfigError, match="not both"):
        translate({"activation_checkpointing": {Block}, "activation_checkpointing_policy": {Block}})


def test_strategy_takes_fsdp_strategy_kwargs_unchanged():
    from fsdp_plugin.integrations.lightning import FSDPPluginStrategy

    strategy = FSDPPluginStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy=ModuleWrapPolicy({Block}),
                                  activation_checkpointing_policy={Block}, cpu_offload=False, state_dict_type="full",
                                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), limit_all_gathers=True)
    cfg = strategy.sharding_config
    assert (cfg.sharding_strategy, cfg.auto_wrap_policy, cfg.activation_checkpointing) == ("shard_grad_op", {Block},
                                                                                            {Block})
    assert cfg.mixed_precision.param_dtype == torch.bfloat16 and strategy.state_dict_type == "full"
    with pytest.raises(TypeError, match="activation_checkpointing_policy"):
        FSDPPluginStrategy(not_an_option=1)


def test_fabric_strategy_takes_them_too():
    from fsdp_plugin.integrations.lightning import FSDPPluginFabricStrategy

    strategy = FSDPPluginFabricStrategy(sharding_strategy=ShardingStrategy.NO_SHARD, state_dict_type="sharded",
                                        activation_checkpointing_policy=ModuleWrapPolicy({Block}))
    assert strategy.sharding_config.sharding_strategy == "no_shard"
    assert strategy.sharding_config.activation_checkpointing == {Block}
    with pytest.raises(fp.ConfigError, match="consolidate"):
        FSDPPluginFabricStrategy(state_dict_type="full")


def test_checkpointing_policy_object_passes_with_its_modules_translated():
    from fsdp_plugin.integrations.lightning import FSDPPluginStrategy

    ac = fp.Checkpointing(modules=ModuleWrapPolicy({Block}), every=2, selective=True)
    strategy = FSDPPluginStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy=ac)
    assert strategy.sharding_config.activation_checkpointing == fp.Checkpointing({Block}, every=2, selective=True)
    assert translate({"activation_checkpointing_policy": fp.Checkpointing(selective=True)})[
        "activation_checkpointing"] == fp.Checkpointing(selective=True)
