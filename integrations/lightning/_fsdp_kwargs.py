"""Lightning ``FSDPStrategy`` keyword arguments → ``fp.ShardingConfig`` fields: migration in one line.

A ``FSDPStrategy(...)`` user changes only the class (``FSDPPluginStrategy(...)``, same arguments). Lightning's
own spellings are handled here (``activation_checkpointing_policy``, torch flags whose value is what
fsdp_plugin always does, arguments with no counterpart); every torch FSDP value (strategy enums,
``MixedPrecision``, ``CPUOffload``, wrap policies, ...) goes through the integrations' one translator,
:mod:`fsdp_plugin.integrations.accelerate.config.torch_fsdp_args` (its table lists them). Values we cannot honour raise
:class:`fp.ConfigError` naming our equivalent.
"""
from __future__ import annotations

from typing import Any

import fsdp_plugin as fp
from fsdp_plugin.integrations.accelerate.config import torch_fsdp_args as torch_args

#: FSDP keyword arguments with no counterpart: the message says what to do instead.
_REFUSED = {
    "device_id": "the strategy places each rank on its device; drop it (ShardingConfig.device overrides)",
    "ignored_states": "pass the modules as ignored_modules=[...]",
    "forward_prefetch_limit": "fsdp_plugin prefetches one unit ahead; drop it",
    "activation_checkpointing_offload": "not supported; drop it (activation_checkpointing recomputes instead)",
}


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``FSDPStrategy``-style keyword arguments → ``ShardingConfig`` keyword arguments (a new dict)."""
    out = dict(kwargs)
    for key, why in _REFUSED.items():
        if key in out:
            raise fp.ConfigError(f"FSDPPluginStrategy({key}=...): {why}")
    if "activation_checkpointing_policy" in out:
        if out.get("activation_checkpointing") is not None:
            raise fp.ConfigError("FSDPPluginStrategy: give activation_checkpointing_policy or activation_checkpointing, "
                                 "not both (they are the same option)")
        out["activation_checkpointing"] = out.pop("activation_checkpointing_policy")
    _zero_quantization(out)
    _flag(out, "use_orig_params", True, "fsdp_plugin always trains the original parameters "
          "(use_orig_params=True); drop the argument")
    _flag(out, "sync_module_states", True, "fsdp_plugin always starts every rank from rank 0's values "
          "(sync_module_states=True); drop the argument")
    return torch_args.translate(out)


def _zero_quantization(out: dict[str, Any]) -> None:
    """DeepSpeedStrategy users' ``zero_quantized_weights=True`` / ``zero_quantized_gradients=True`` →
    ``quantization=fp.Quantization(...)`` (int8); refused next to an explicit ``quantization=``."""
    keys = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if k in out]
    if not keys:
        return
    if out.get("quantization") is not None:
        raise fp.ConfigError(f"FSDPPluginStrategy: give quantization=fp.Quantization(...) or {', '.join(keys)}, "
                             "not both (they are the same option)")
    from fsdp_plugin.integrations.accelerate.config.parse import zero_quantization
    out["quantization"] = zero_quantization(bool(out.pop("zero_quantized_weights", False)),
                                                 bool(out.pop("zero_quantized_gradients", False)))


def _flag(out: dict[str, Any], key: str, ours: bool, why: str) -> None:
    """Drop a torch flag whose value is what fsdp_plugin always does; refuse the other value."""
    if key not in out:
        return
    if bool(out.pop(key)) != ours:
        raise fp.ConfigError(f"FSDPPluginStrategy({key}={not ours}): {why}")
