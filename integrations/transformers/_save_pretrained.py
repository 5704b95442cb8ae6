"""``save_pretrained`` on a sharded model (transformers ``PreTrainedModel`` and PEFT ``PeftModel``).

Collective on a sharded model: rank 0 runs the library's own ``save_pretrained`` on meta stand-ins (so PEFT
keeps only the adapter, transformers its config, naming, tie and split rules) with its safetensors writes
captured, and every rank then writes its own byte ranges of those files (``_ranged_save``): no gather, the
same bytes. Unsharded models and calls that pass ``state_dict=`` go straight to the stock method.
"""
from __future__ import annotations

from collections.abc import Callable

from fsdp_plugin._build.library_save import wrap

_ORIGINALS: list[tuple[type, Callable]] = []


def _classes() -> list[type]:
    from transformers import PreTrainedModel

    classes = [PreTrainedModel]
    try:
        from peft import PeftModel
    except ImportError:  # PEFT is optional
        return classes
    return classes + [PeftModel]


def install() -> None:
    """Patch ``save_pretrained`` of ``PreTrainedModel`` (and ``PeftModel``). Idempotent."""
    if _ORIGINALS:
        return
    for cls in _classes():
        stock = cls.__dict__["save_pretrained"]
        _ORIGINALS.append((cls, stock))
        cls.save_pretrained = wrap(stock)   # the engine's wrapper (fp.shard installs it on sharded roots too)


def uninstall() -> None:
    """Restore the stock methods."""
    while _ORIGINALS:
        cls, stock = _ORIGINALS.pop()
        cls.save_pretrained = stock
