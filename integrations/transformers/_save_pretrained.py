"""``save_pretrained`` on a sharded model (transformers ``PreTrainedModel`` and PEFT ``PeftModel``).

Collective on a sharded model: the full state dict is gathered to rank 0 (``fp.full_state_dict``), which
writes with the library's own ``save_pretrained`` (so PEFT keeps only the adapter, transformers its config
and naming rules); the other ranks write nothing. Unsharded models and calls that pass ``state_dict=``
go straight to the stock method.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import fsdp_plugin as fp

_ORIGINALS: list[tuple[type, Callable]] = []


def _wrap(stock: Callable) -> Callable:
    @functools.wraps(stock)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is not None or not fp.is_sharded(self):
            return stock(self, save_directory, *args, **kwargs)
        from fsdp_plugin.checkpoint import _comm

        state_dict = fp.full_state_dict(self)  # collective: rank 0 gets every tensor, other ranks {}
        result, err = None, None
        if _comm.rank() == 0:
            try:
                result = stock(self, save_directory, *args, **{**kwargs, "state_dict": state_dict,
                                                               "is_main_process": True})
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below, so none waits forever
                err = e
        _comm.raise_if_any_failed(err)  # collective: also the barrier after which the files exist
        return result

    save_pretrained.__fsdp_plugin__ = True
    return save_pretrained


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
        cls.save_pretrained = _wrap(stock)


def uninstall() -> None:
    """Restore the stock methods."""
    while _ORIGINALS:
        cls, stock = _ORIGINALS.pop()
        cls.save_pretrained = stock
