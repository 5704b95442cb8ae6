"""Precision flags → engine policy, and strategy argument validation (in-process: no fit, no launcher)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl
from fsdp_plugin.integrations.lightning import FSDPPluginPrecision, FSDPPluginStrategy
from fsdp_plugin.integrations.lightning._precision_map import (
    SUPPORTED_FLAGS,
    precision_spec,
)

import fsdp_plugin as fp


def _plugin(flag: str) -> FSDPPluginPrecision:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FSDPPluginStrategy(), precision=flag, logger=False)
    return trainer.strategy.precision_plugin


@pytest.mark.parametrize(
    "flag, param_dtype, autocast, module_dtype",
    [("32-true", None, None, None), ("bf16-mixed", torch.bfloat16, torch.bfloat16, None),
     ("bf16-true", None, None, torch.bfloat16)],
)
def test_trainer_flags_map_to_engine_policy(flag, param_dtype, autocast, module_dtype):
    plugin = _plugin(flag)
    assert isinstance(plugin, FSDPPluginPrecision) and plugin.precision == flag
    policy = plugin.mixed_precision()
    if param_dtype is None:
        assert policy is None
    else:
        assert isinstance(policy, fp.MixedPrecision)
        assert policy.param_dtype == param_dtype and policy.reduce_dtype == torch.float32  # fp32 reduction
    assert plugin.spec.autocast_dtype == autocast and plugin.spec.module_dtype == module_dtype
    assert plugin.scaler is None


def test_bf16_true_casts_module_and_inputs():
    plugin = _plugin("bf16-true")
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2)).dtype == torch.bfloat16
    with plugin.forward_context():
        assert torch.empty(1).dtype == torch.bfloat16


def test_16_mixed_needs_cuda_and_gets_a_sharded_scaler():
    with pytest.raises(ValueError, match="needs CUDA"):
        precision_spec("16-mixed", "cpu")
    spec = precision_spec("16-mixed", "cuda")
    assert spec.scaler and spec.param_dtype == torch.float16 and spec.reduce_dtype == torch.float32


@pytest.mark.parametrize("flag", ["64-true", "16-true"])
def test_unsupported_flags_are_refused_listing_supported_ones(flag):
    with pytest.raises((TypeError, ValueError)) as err:
        _plugin(flag)
    assert flag in str(err.value) and all(f in str(err.value) for f in SUPPORTED_FLAGS), str(err.value)


def test_explicit_mixed_precision_overrides_the_flag():
    from fsdp_plugin.integrations.lightning._plumbing import with_precision

    explicit = fp.MixedPrecision(param_dtype=torch.float16)
    strategy = FSDPPluginStrategy(mixed_precision=explicit)
    cfg = with_precision(strategy.sharding_config, _plugin("bf16-mixed"))
    assert cfg.mixed_precision is explicit


def test_strategy_arguments_are_validated_eagerly():
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        FSDPPluginStrategy(auto_wrap_polcy={torch.nn.Linear})
    with pytest.raises(ValueError, match="state_dict_type"):
        FSDPPluginStrategy(state_dict_type="distributed")
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDPPluginStrategy(sharding_strategy="zero3")
    assert FSDPPluginStrategy(sharding_strategy="shard_grad_op").sharding_config.sharding_strategy == "shard_grad_op"


def test_unsupported_checkpoint_value_fails_before_any_collective(tmp_path):
    from fsdp_plugin import CodecError

    strategy = FSDPPluginStrategy()

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran before the checkpoint state was validated")

    strategy.broadcast = no_collective
    with pytest.raises(CodecError, match=r"hyper_parameters\.cfg.*object"):
        strategy.save_checkpoint({"epoch": 0, "hyper_parameters": {"cfg": object()}}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
