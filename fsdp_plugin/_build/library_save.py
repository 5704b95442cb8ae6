"""transformers' and PEFT's own ``model.save_pretrained(dir)`` on a sharded model, with no other import.

On a sharded model the stock method would call ``state_dict()``, which the guards refuse (it would hold shard
pieces). ``fp.shard`` therefore gives a sharded ``PreTrainedModel`` / ``PeftModel`` root an instance-level
``save_pretrained`` that runs the library's own method the way the transformers integration does
(``fsdp_plugin.integrations._ranged_save``): rank 0 runs it on meta stand-ins, so PEFT keeps only the adapters
and transformers writes its config, names, tie and split rules; its safetensors writes are captured and every
rank writes its own byte ranges (no gather of the base). Collective: every rank calls it. Calls that pass
``state_dict=`` go to the stock method, as on one GPU. The integration's class-level patch uses the same
wrapper (``wrap``), so there is one implementation.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable

from torch import nn

_LIBRARY_ROOTS = {("transformers", "PreTrainedModel"), ("peft", "PeftModel")}


def _is_library_model(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` or PEFT ``PeftModel`` (neither library is imported here)."""
    return any((c.__module__.split(".")[0], c.__name__) in _LIBRARY_ROOTS for c in type(module).__mro__)


def wrap(stock: Callable) -> Callable:
    """``stock`` (an unbound ``save_pretrained``) made collective on sharded models (module doc)."""
    @functools.wraps(stock)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is not None or getattr(self, "_fp_root", None) is None:
            return stock(self, save_directory, *args, **kwargs)
        from ..integrations._ranged_save import save_like_library

        return save_like_library(self, lambda state_dict: stock(self, save_directory, *args, **{
            **kwargs, "state_dict": state_dict, "is_main_process": True}), "save_pretrained")

    save_pretrained.__fsdp_plugin__ = True
    return save_pretrained


def install_library_save(model: nn.Module) -> bool:
    """Give a sharded transformers/PEFT root the collective ``save_pretrained``; False when not one (or when its
    class is already patched by ``fsdp_plugin.integrations.transformers``)."""
    stock = getattr(type(model), "save_pretrained", None)
    if stock is None or not _is_library_model(model) or getattr(stock, "__fsdp_plugin__", False):
        return False
    model.save_pretrained = types.MethodType(wrap(stock), model)
    return True
