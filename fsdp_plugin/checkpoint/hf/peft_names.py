"""A PEFT model's base weights under the names of the base model's checkpoint (``fp.load_pretrained``).

``peft.get_peft_model`` wraps the base (``base_model.model.``) and moves each adapted layer's weight under
``base_layer``; the full-precision checkpoint of the base (the 70B QLoRA path: skeleton + LoRA built under
``fp.deferred_init()``, ``fp.shard``, then ``fp.load_pretrained``) has the plain names and no adapters. PEFT is
not imported: its tuner layers are recognized by the attributes PEFT's ``BaseTunerLayer`` defines.
"""
from __future__ import annotations

from torch import nn

_PREFIX = "base_model.model."


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def base_name(fqn: str) -> str:
    """``base_model.model.X.base_layer.weight`` -> ``X.weight`` (the base model's own name)."""
    name = fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else fqn
    return name.replace(".base_layer.", ".")


def adapter_params(model: nn.Module) -> set:
    """Names of the adapters' parameters (LoRA A/B, DoRA magnitudes, ...): in no base checkpoint."""
    out = set()
    for fqn, module in model.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        for attr in getattr(module, "adapter_layer_names", ()):
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.Module):
                out.update(f"{fqn}.{attr}.{n}" for n, _ in sub.named_parameters())
    return out
