"""Precision plugins for the Trainer and Fabric strategies (flag semantics: ``_precision_map``).

The strategies replace whatever precision plugin Lightning's connector built from the ``precision=``
flag with one of these. They differ from Lightning's own plugins in three ways: autocast follows the
root device (CPU bf16 works), gradient clipping by norm goes through ``fp.clip_grad_norm_`` (a norm over
sharded gradients), and the fp16 loss scaler (``fp.GradScaler``) agrees on inf/nan across ranks.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from fsdp_plugin.integrations.lightning._precision_map import (
    PrecisionSpec,
    precision_spec,
)
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import (
    _convert_fp_tensor,
    _DtypeContextManager,
)
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from torch import Tensor
from fsdp_plugin.errors import NonFiniteGradientError


class _PrecisionCore:
    """Flag-driven behaviour shared by the Trainer and Fabric plugins."""

    def __init__(self, precision: str = "32-true", device_type: str = "cpu") -> None:
        self.spec: PrecisionSpec = precision_spec(precision, device_type)
        self.precision = self.spec.flag
        self.device_type = device_type
        self.scaler: Any | None = _sharded_scaler(device_type) if self.spec.scaler else None

    def mixed_precision(self) -> Any:
        """The ``fp.MixedPrecision`` policy for the engine (None for pure fp32)."""
        return self.spec.mixed_precision()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``*-true``: cast the module before sharding, so shards and optimizer state are half precision.

        A module already in that dtype (built under ``module_init_context``, e.g. in ``configure_model``)
        is left alone: ``.to()`` on deferred-init tensors would detach them from their recorded init."""
        dtype = self.spec.module_dtype
        tensors = [*module.parameters(), *module.buffers()]
        if dtype is None or all(t.dtype == dtype for t in tensors if t.is_floating_point()):
            return module
        return module.to(dtype)

    def tensor_init_context(self) -> Any:
        dtype = self.spec.module_dtype
        return _DtypeContextManager(dtype) if dtype is not None else nullcontext()

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    def forward_context(self) -> Any:
        if self.spec.autocast_dtype is not None:
            return torch.autocast(self.device_type, dtype=self.spec.autocast_dtype, cache_enabled=False)
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        dtype = self.spec.module_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=dtype)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def clip_norm(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                  error_if_nonfinite: bool = False) -> Tensor:
        """Clip by the global norm of the (sharded) gradients; the same norm on every rank."""
        import fsdp_plugin as fp

        norm = fp.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise NonFiniteGradientError(
                f"The total norm of order {norm_type} of the gradients is non-finite ({norm.item()}).")
        return norm


class FSDPPluginPrecision(_PrecisionCore, TrainerPrecision):
    """Trainer precision plugin for :class:`FSDPPluginStrategy`."""

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self.scaler.unscale_(optimizer)  # before clipping, agreed across ranks
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.clip_norm(self.main_params(optimizer), clip_val)


class FSDPPluginFabricPrecision(_PrecisionCore, FabricPrecision):
    """Fabric precision plugin for :class:`FSDPPluginFabricStrategy`."""

    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    def unscale_gradients(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def _sharded_scaler(device_type: str) -> Any:
    """The engine's loss scaler: torch's GradScaler with the inf/NaN check agreed across ranks."""
    import fsdp_plugin as fp

    return fp.GradScaler(device_type)


def flag_of(plugin: Any) -> Any:
    """The precision flag of a plugin Lightning's connector built (``Precision`` has none: 32-true)."""
    flag = getattr(plugin, "precision", "32-true")
    return "32-true" if flag in ("32", 32) else flag
