"""Lightning ``FSDPStrategy`` keyword arguments → ``fp.ShardingConfig`` fields: migration in one line.

A ``FSDPStrategy(...)`` user changes only the class (``FSDPPluginStrategy(...)``, same arguments): torch's
and Lightning's spellings are translated here, values we cannot honour raise :class:`fp.ConfigError` naming
our equivalent. Our own spellings (``fp.MixedPrecision``, a set of classes, ``fp.size_policy``, a
``callable(module) -> bool``, lower-case strategy names) pass through unchanged. torch objects are
recognised by class name and attributes: nothing here imports torch's FSDP package.

| FSDPStrategy / torch FSDP                         | fsdp_plugin                                   |
|---------------------------------------------------|-----------------------------------------------|
| ``sharding_strategy="FULL_SHARD"`` / enum         | ``"full_shard"`` (same for the other three)   |
| ``cpu_offload=True`` / ``CPUOffload(True)``       | ``cpu_offload=True``                          |
| ``mixed_precision=torch MixedPrecision(...)``     | ``fp.MixedPrecision(...)`` (same dtypes)      |
| ``auto_wrap_policy=ModuleWrapPolicy({B})``, a set | ``{B}``                                       |
| ``partial(transformer_auto_wrap_policy, ...)``    | ``set(transformer_layer_cls)``                |
| ``(partial of) size_based_auto_wrap_policy``      | ``fp.size_policy(min_num_params)``            |
| ``activation_checkpointing_policy``               | ``activation_checkpointing``                  |
| ``backward_prefetch=BackwardPrefetch.X`` / None   | ``backward_prefetch=True`` / ``False``        |
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

import fsdp_plugin as fp

_STRATEGIES = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
               "HYBRID_SHARD": "hybrid_shard"}
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
    _flag(out, "use_orig_params", True, "fsdp_plugin always trains the original parameters "
          "(use_orig_params=True); drop the argument")
    _flag(out, "sync_module_states", True, "fsdp_plugin always starts every rank from rank 0's values "
          "(sync_module_states=True); drop the argument")
    for key, fn in (("sharding_strategy", sharding_strategy), ("cpu_offload", cpu_offload),
                    ("mixed_precision", mixed_precision), ("backward_prefetch", backward_prefetch)):
        if key in out:
            out[key] = fn(out[key])
    if "auto_wrap_policy" in out:
        out["auto_wrap_policy"] = wrap_policy(out["auto_wrap_policy"], "auto_wrap_policy")
    if "activation_checkpointing" in out:
        out["activation_checkpointing"] = checkpoint_policy(out["activation_checkpointing"])
    return out


def _flag(out: dict[str, Any], key: str, ours: bool, why: str) -> None:
    """Drop a torch flag whose value is what fsdp_plugin always does; refuse the other value."""
    if key not in out:
        return
    if bool(out.pop(key)) != ours:
        raise fp.ConfigError(f"FSDPPluginStrategy({key}={not ours}): {why}")


def _enum_name(value: Any) -> Any:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else value


def sharding_strategy(value: Any) -> Any:
    """torch's ``ShardingStrategy`` member or Lightning's upper-case name → our lower-case name."""
    text = _enum_name(value)
    if not isinstance(text, str):
        return value
    name = text.strip().upper()
    if name in ("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"):
        raise fp.ConfigError(f"sharding_strategy={text!r}: use 'hybrid_shard' (parameters resharded after forward "
                             "inside the shard group) or 'shard_grad_op'")
    return _STRATEGIES.get(name, text)


def cpu_offload(value: Any) -> bool:
    """``None``/bool, torch ``CPUOffload(offload_params=...)`` or FSDP2 ``CPUOffloadPolicy`` → bool."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if hasattr(value, "offload_params"):
        return bool(value.offload_params)
    if type(value).__name__ == "CPUOffloadPolicy":
        return True
    raise fp.ConfigError(f"cpu_offload={value!r}: use True/False (or torch's CPUOffload(offload_params=...))")


def backward_prefetch(value: Any) -> bool:
    """torch ``BackwardPrefetch.BACKWARD_PRE``/``BACKWARD_POST`` → True, ``None`` → False; bools pass."""
    if value is None or isinstance(value, bool):
        return bool(value)
    name = str(_enum_name(value)).upper()
    if name in ("BACKWARD_PRE", "BACKWARD_POST"):
        return True
    raise fp.ConfigError(f"backward_prefetch={value!r}: use True/False (or torch's BackwardPrefetch member, or None)")


def mixed_precision(value: Any) -> Any:
    """torch ``MixedPrecision`` (FSDP1) or ``MixedPrecisionPolicy`` (FSDP2) → ``fp.MixedPrecision``."""
    if value is None or isinstance(value, fp.MixedPrecision):
        return value
    if not all(hasattr(value, a) for a in ("param_dtype", "reduce_dtype")):
        raise fp.ConfigError(f"mixed_precision={value!r}: use fp.MixedPrecision(param_dtype=..., reduce_dtype=...) "
                             "or torch's MixedPrecision")
    if getattr(value, "keep_low_precision_grads", False):
        raise fp.ConfigError("mixed_precision=MixedPrecision(keep_low_precision_grads=True): fsdp_plugin keeps "
                             "gradients in float32 next to the float32 master shard; drop keep_low_precision_grads")
    if getattr(value, "output_dtype", None) is not None:
        raise fp.ConfigError("mixed_precision=MixedPrecisionPolicy(output_dtype=...): cast the outputs yourself; "
                             "fp.MixedPrecision has param_dtype, reduce_dtype, buffer_dtype, cast_forward_inputs")
    cast = bool(getattr(value, "cast_root_forward_inputs", False) or getattr(value, "cast_forward_inputs", False))
    return fp.MixedPrecision(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype,
                             buffer_dtype=getattr(value, "buffer_dtype", None), cast_forward_inputs=cast)


def wrap_policy(value: Any, key: str) -> Any:
    """torch's policies (``ModuleWrapPolicy``, partials of ``transformer_auto_wrap_policy`` /
    ``size_based_auto_wrap_policy`` / ``lambda_auto_wrap_policy``, ``CustomPolicy``, torch-style callables),
    a class or a list of classes → what ``ShardingConfig`` takes. Ours pass through."""
    if value is None or isinstance(value, (set, frozenset)) or type(value).__name__ == "_SizePolicy":
        return value
    if isinstance(value, type) and issubclass(value, nn.Module):
        return {value}
    if isinstance(value, (list, tuple)) and all(isinstance(c, type) for c in value):
        return set(value)
    if hasattr(value, "_module_classes"):  # torch's ModuleWrapPolicy
        return set(value._module_classes)
    if hasattr(value, "_lambda_fn"):  # torch's CustomPolicy
        return functools.partial(_custom_policy, value._lambda_fn)
    func = value.func if isinstance(value, functools.partial) else value
    kw = dict(value.keywords) if isinstance(value, functools.partial) else {}
    name = getattr(func, "__name__", "")
    if name == "transformer_auto_wrap_policy":
        if not kw.get("transformer_layer_cls"):
            raise fp.ConfigError(f"{key}=transformer_auto_wrap_policy needs transformer_layer_cls: pass "
                                 f"functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{Block}}) "
                                 f"or simply {key}={{Block}}")
        return set(kw["transformer_layer_cls"])
    if name == "size_based_auto_wrap_policy":
        extra = sorted(k for k, v in kw.items() if k != "min_num_params" and v is not None)
        if extra:
            raise fp.ConfigError(f"{key}=size_based_auto_wrap_policy with {extra}: not supported; use "
                                 "fp.size_policy(min_params) or a callable(module) -> bool")
        return fp.size_policy(int(kw.get("min_num_params", 100_000_000)))
    if name == "lambda_auto_wrap_policy":
        return functools.partial(_custom_policy, kw["lambda_fn"])
    if callable(value):
        return functools.partial(_torch_style, value) if _is_torch_style(value) else value
    raise fp.ConfigError(f"{key}={value!r}: use a set of module classes, a callable(module) -> bool, "
                         "fp.size_policy(min_params) or one of torch's wrap policies")


def checkpoint_policy(value: Any) -> Any:
    """Like :func:`wrap_policy`; a size policy becomes a callable (activation checkpointing takes callables)."""
    policy = wrap_policy(value, "activation_checkpointing_policy")
    if type(policy).__name__ == "_SizePolicy":
        return _SizeSelector(policy.min_params)
    return policy


def _is_torch_style(fn: Any) -> bool:
    """torch's policy signature: ``(module, recurse, nonwrapped_numel)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _torch_style(policy: Any, module: nn.Module) -> bool:
    return bool(policy(module=module, recurse=False, nonwrapped_numel=_numel(module)))


def _custom_policy(fn: Any, module: nn.Module) -> bool:
    """``CustomPolicy``/``lambda_auto_wrap_policy``: a bool, or a dict of per-module FSDP kwargs (refused)."""
    result = fn(module)
    if isinstance(result, dict) and result:
        raise fp.ConfigError(f"a wrap policy returned per-module FSDP arguments {sorted(result)} for "
                             f"{type(module).__name__}: fsdp_plugin applies one ShardingConfig to every unit; "
                             "return True/False")
    return bool(result)


class _SizeSelector:
    """torch's size-based selection, bottom-up: a module is selected when the parameters of its subtree that
    no selected descendant already covers reach ``min_params`` (the root itself is never selected)."""

    def __init__(self, min_params: int) -> None:
        self.min_params = min_params
        self._uncovered: dict[int, int] = {}

    def _rest(self, module: nn.Module) -> int:
        if id(module) not in self._uncovered:
            own = sum(p.numel() for p in module.parameters(recurse=False))
            kids = sum(0 if self(c) else self._rest(c) for c in module.children())
            self._uncovered[id(module)] = own + kids
        return self._uncovered[id(module)]

    def __call__(self, module: nn.Module) -> bool:
        return self._rest(module) >= self.min_params
