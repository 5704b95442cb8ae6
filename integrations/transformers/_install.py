"""Patch ``transformers.Trainer`` in place (and undo it): the Accelerator class and a few methods.

Methods are replaced on ``Trainer`` itself so that subclasses (TRL's trainers, user subclasses) inherit
them; each replacement calls the stock method unless fsdp_plugin's engine is active for that Trainer.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from .. import _hf_loading as _loading
from . import _save_pretrained, _trainer, _trl

_ORIGINALS: dict[str, Callable] = {}
_MODULE_ACCELERATOR: list = []

# Trainer method name -> replacement(stock_method, self, *args, **kwargs)
_OVERRIDES: dict[str, Callable] = {
    "create_accelerator_and_postprocess": _trainer.create_accelerator_and_postprocess,
    "_move_model_to_device": _trainer.move_model_to_device,
    "save_model": _trainer.save_model,
    "_save_optimizer_and_scheduler": _trainer.save_optimizer_and_scheduler,
    "_load_from_checkpoint": _trainer.load_from_checkpoint,
    "_load_optimizer_and_scheduler": _trainer.load_optimizer_and_scheduler,
    "_load_best_model": _trainer.load_best_model,
    "train": _trainer.train,
    "_save_checkpoint": _trainer.save_checkpoint,
}


def _bind(stock: Callable, replacement: Callable) -> Callable:
    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        return replacement(stock, self, *args, **kwargs)

    method.__fsdp_plugin__ = True
    return method


def install() -> None:
    """Make ``transformers.Trainer`` use fsdp_plugin when FSDP is selected. Idempotent."""
    import transformers.trainer as trainer_module

    from fsdp_plugin.integrations.accelerate.accelerator import Accelerator

    _trl.patch_loaded()   # TRL modules imported since: their vLLM sync too (idempotent)
    if _ORIGINALS:
        return
    cls = trainer_module.Trainer
    for name, replacement in _OVERRIDES.items():
        stock = cls.__dict__[name]
        _ORIGINALS[name] = stock
        setattr(cls, name, _bind(stock, replacement))
    _MODULE_ACCELERATOR.append(trainer_module.Accelerator)
    trainer_module.Accelerator = Accelerator
    _save_pretrained.install()
    _loading.install()


def uninstall() -> None:
    """Restore the stock ``Trainer`` (Trainers created afterwards are stock)."""
    import transformers.trainer as trainer_module

    for name, stock in _ORIGINALS.items():
        setattr(trainer_module.Trainer, name, stock)
    _ORIGINALS.clear()
    if _MODULE_ACCELERATOR:
        trainer_module.Accelerator = _MODULE_ACCELERATOR.pop()
    _save_pretrained.uninstall()
    _loading.uninstall()
    _trl.unpatch()


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_ORIGINALS)
