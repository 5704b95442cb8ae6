"""torch FSDP's options → ``fp.ShardingConfig`` fields: the one translator of every integration.

Lightning's ``FSDPStrategy(...)`` keyword arguments and accelerate's ``FullyShardedDataParallelPlugin``
(whose ``__post_init__`` has already parsed the user's strings into torch's enums, ``MixedPrecision``,
``CPUOffload`` and wrap-policy functions) carry the same torch objects; both go through :func:`translate`.
Values we cannot honour raise the caller's error naming our equivalent. Our own spellings
(``fp.MixedPrecision``, a set of classes, ``fp.size_policy``, a ``callable(module) -> bool``, lower-case
strategy names) pass through unchanged. torch objects are recognised by class name and attributes: nothing
here imports torch's FSDP package.

| torch FSDP                                        | fsdp_plugin                                   |
|---------------------------------------------------|-----------------------------------------------|
| ``sharding_strategy="FULL_SHARD"`` / enum         | ``"full_shard"`` (same for the other three)   |
| ``cpu_offload=True`` / ``CPUOffload(True)``       | ``cpu_offload=True``                          |
| ``mixed_precision=torch MixedPrecision(...)``     | ``fp.MixedPrecision(...)`` (same dtypes;      |
|                                                   | ``_module_classes_to_ignore`` → fp32_modules) |
| ``auto_wrap_policy=ModuleWrapPolicy({B})``, a set | ``{B}``                                       |
| ``partial(transformer_auto_wrap_policy, ...)``    | ``set(transformer_layer_cls)``                |
| ``(partial of) size_based_auto_wrap_policy``      | ``fp.size_policy(min_num_params)``            |
| ``backward_prefetch=BackwardPrefetch.X`` / None   | ``backward_prefetch=True`` / ``False``        |
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.config import _SizePolicy

#: ``error(key, value, why)`` → the exception to raise (the caller's class and naming of the key).
ErrorFactory = Callable[[str, Any, str], Exception]

STRATEGY_NAMES = {"FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
                  "HYBRID_SHARD": "hybrid_shard"}
_VALUES = ("sharding_strategy", "cpu_offload", "mixed_precision", "backward_prefetch", "auto_wrap_policy",
           "activation_checkpointing")


def config_error(key: str, value: Any, why: str) -> fp.ConfigError:
    """The default :data:`ErrorFactory`: ``fp.ConfigError("key=value: why")``."""
    return fp.ConfigError(f"{key}={value!r}: {why}")


def translate(kwargs: dict[str, Any], error: ErrorFactory = config_error) -> dict[str, Any]:
    """torch-FSDP-style keyword arguments → ``ShardingConfig`` keyword arguments (a new dict; other keys kept).

    Translates ``sharding_strategy``, ``cpu_offload``, ``mixed_precision``, ``backward_prefetch``,
    ``auto_wrap_policy`` and ``activation_checkpointing``; ``forward_prefetch``/``limit_all_gathers`` and our
    own fields pass as they are.
    """
    out = dict(kwargs)
    for key in _VALUES:
        if key in out:
            out[key] = _TRANSLATORS[key](out[key], key, error)
    return out


def enum_name(value: Any) -> Any:
    """A torch/accelerate enum member → its name; anything else unchanged."""
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else value


def sharding_strategy(value: Any, key: str = "sharding_strategy", error: ErrorFactory = config_error) -> Any:
    """torch's ``ShardingStrategy`` member or its (any-case) name → our lower-case name; others unchanged."""
    text = enum_name(value)
    if not isinstance(text, str):
        return value
    name = text.strip().upper()
    if name in ("HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"):
        raise error(key, text, "use 'hybrid_shard' (parameters resharded after forward inside the shard group) "
                               "or 'shard_grad_op'")
    return STRATEGY_NAMES.get(name, text)


def cpu_offload(value: Any, key: str = "cpu_offload", error: ErrorFactory = config_error) -> bool:
    """``None``/bool, torch ``CPUOffload(offload_params=...)``, FSDP2 ``CPUOffloadPolicy`` (True) or its
    no-offload base ``OffloadPolicy()`` (False) → bool."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if hasattr(value, "offload_params"):
        return bool(value.offload_params)
    if type(value).__name__ in ("CPUOffloadPolicy", "OffloadPolicy"):
        return type(value).__name__ == "CPUOffloadPolicy"
    raise error(key, value, "use True/False (or torch's CPUOffload(offload_params=...))")


def backward_prefetch(value: Any, key: str = "backward_prefetch", error: ErrorFactory = config_error) -> bool:
    """``BackwardPrefetch.BACKWARD_PRE``/``BACKWARD_POST`` (member or name) → True; ``None``/``NO_PREFETCH``
    → False; bools pass."""
    if value is None or isinstance(value, bool):
        return bool(value)
    name = str(enum_name(value)).strip().upper()
    if name in ("BACKWARD_PRE", "BACKWARD_POST"):
        return True
    if name in ("NO_PREFETCH", "NONE"):
        return False
    raise error(key, value, "use True/False (or torch's BackwardPrefetch member, or None)")


def mixed_precision(value: Any, key: str = "mixed_precision", error: ErrorFactory = config_error) -> Any:
    """torch ``MixedPrecision`` (FSDP1) or ``MixedPrecisionPolicy`` (FSDP2) → ``fp.MixedPrecision``."""
    if value is None or isinstance(value, fp.MixedPrecision):
        return value
    if not all(hasattr(value, a) for a in ("param_dtype", "reduce_dtype")):
        raise error(key, value, "use fp.MixedPrecision(param_dtype=..., reduce_dtype=...) or torch's MixedPrecision")
    if getattr(value, "keep_low_precision_grads", False):
        raise error(key, value, "keep_low_precision_grads=True: fsdp_plugin keeps gradients in float32 next to the "
                                "float32 master shard; drop keep_low_precision_grads")
    if getattr(value, "output_dtype", None) is not None:
        raise error(key, value, "output_dtype: cast the outputs yourself; fp.MixedPrecision has param_dtype, "
                                "reduce_dtype, buffer_dtype, cast_forward_inputs")
    cast = bool(getattr(value, "cast_root_forward_inputs", False) or getattr(value, "cast_forward_inputs", False))
    # FSDP1 runs the modules of `_module_classes_to_ignore` (default: BatchNorm) outside mixed precision
    low = value.param_dtype is not None and value.param_dtype.itemsize < 4
    keep = tuple(getattr(value, "_module_classes_to_ignore", None) or ()) if low else ()
    return fp.MixedPrecision(param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype,
                             buffer_dtype=getattr(value, "buffer_dtype", None), cast_forward_inputs=cast,
                             fp32_modules=keep)


def wrap_policy(value: Any, key: str = "auto_wrap_policy", error: ErrorFactory = config_error) -> Any:
    """torch's policies (``ModuleWrapPolicy``, partials of ``transformer_auto_wrap_policy`` /
    ``size_based_auto_wrap_policy`` / ``lambda_auto_wrap_policy``, ``CustomPolicy``, torch-style callables),
    a class or a list of classes → what ``ShardingConfig`` takes. Ours pass through."""
    if value is None or isinstance(value, (set, frozenset, _SizePolicy)):
        return value
    if isinstance(value, type) and issubclass(value, nn.Module):
        return {value}
    if isinstance(value, (list, tuple)) and all(isinstance(c, type) for c in value):
        return set(value)
    if hasattr(value, "_module_classes"):  # torch's ModuleWrapPolicy
        return set(value._module_classes)
    if hasattr(value, "_lambda_fn"):  # torch's CustomPolicy
        return functools.partial(_custom_policy, value._lambda_fn)
    name, kw = policy_function(value)
    if name == "transformer_auto_wrap_policy":
        if not kw.get("transformer_layer_cls"):
            raise error(key, value, "transformer_auto_wrap_policy needs transformer_layer_cls: pass functools."
                                    "partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}) or {Block}")
        return set(kw["transformer_layer_cls"])
    if name == "size_based_auto_wrap_policy":
        extra = sorted(k for k, v in kw.items() if k != "min_num_params" and v is not None)
        if extra:
            raise error(key, value, f"size_based_auto_wrap_policy with {extra}: not supported; use "
                                    "fp.size_policy(min_params) or a callable(module) -> bool")
        return fp.size_policy(int(kw.get("min_num_params", 100_000_000)))
    if name == "lambda_auto_wrap_policy":
        return functools.partial(_custom_policy, kw["lambda_fn"])
    if callable(value):
        return functools.partial(_torch_style, value) if _is_torch_style(value) else value
    raise error(key, value, "use a set of module classes, a callable(module) -> bool, fp.size_policy(min_params) "
                            "or one of torch's wrap policies")


def policy_function(value: Any) -> tuple[str, dict[str, Any]]:
    """``(function name, bound keywords)`` of a policy function or a ``functools.partial`` of one."""
    func = value.func if isinstance(value, functools.partial) else value
    kw = dict(value.keywords) if isinstance(value, functools.partial) else {}
    return getattr(func, "__name__", ""), kw


def checkpoint_policy(value: Any, key: str = "activation_checkpointing", error: ErrorFactory = config_error) -> Any:
    """Modules to recompute: what :func:`wrap_policy` takes (the engine selects by size like auto-wrap), or an
    ``fp.Checkpointing`` (every k-th module, selective) whose ``modules`` are translated the same way."""
    if isinstance(value, fp.Checkpointing):
        if value.modules is None:
            return value
        return dataclasses.replace(value, modules=wrap_policy(value.modules, key, error))
    return wrap_policy(value, key, error)


_TRANSLATORS = {"sharding_strategy": sharding_strategy, "cpu_offload": cpu_offload,
                "mixed_precision": mixed_precision, "backward_prefetch": backward_prefetch,
                "auto_wrap_policy": wrap_policy, "activation_checkpointing": checkpoint_policy}


def _is_torch_style(fn: Any) -> bool:
    """torch's policy signature: ``(module, recurse, nonwrapped_numel)``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in params and "nonwrapped_numel" in params


def _torch_style(policy: Any, module: nn.Module) -> bool:
    numel = sum(p.numel() for p in module.parameters())
    return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))


def _custom_policy(fn: Any, module: nn.Module) -> bool:
    """``CustomPolicy``/``lambda_auto_wrap_policy``: a bool, or a dict of per-module FSDP kwargs (refused)."""
    result = fn(module)
    if isinstance(result, dict) and result:
        raise fp.ConfigError(f"a wrap policy returned per-module FSDP arguments {sorted(result)} for "
                             f"{type(module).__name__}: fsdp_plugin applies one ShardingConfig to every unit; "
                             "return True/False")
    return bool(result)
