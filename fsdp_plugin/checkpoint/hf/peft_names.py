"""A PEFT model's base weights under the names of the base model's checkpoint (``fp.load_pretrained``).

``peft.get_peft_model`` wraps the base (``base_model.model.``) and moves each adapted layer's weight under
``base_layer``; the full-precision checkpoint of the base (the 70B QLoRA path: skeleton + LoRA built under
``fp.deferred_init()``, ``fp.shard``, then ``fp.load_pretrained``) has the plain names and no adapters. The PEFT
model may sit inside the sharded root (a LightningModule's ``self.model``). PEFT is
not imported: its tuner layers are recognized by the attributes PEFT's ``BaseTunerLayer`` defines.
"""
from __future__ import annotations

from torch import nn

def prefixes(model: nn.Module) -> list:
    """``<path>base_model.model.`` for every PEFT model in ``model`` (itself, or e.g. a LightningModule's
    ``self.model``): what precedes the base model's own names."""
    return [f"{fqn}.base_model.model." if fqn else "base_model.model." for fqn, m in model.named_modules()
            if hasattr(m, "peft_config") and hasattr(m, "base_model")]


def base_name(fqn: str, prefixes: list) -> str | None:
    """``<prefix>X.base_layer.weight`` -> ``X.weight`` (the base model's own name); None outside a PEFT model."""
    pre = next((p for p in prefixes if fqn.startswith(p)), None)
    return None if pre is None else fqn[len(pre):].replace(".base_layer.", ".")


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
