"""``import pytorch_lightning as pl; pl.Trainer(strategy="fsdp_plugin")``: the Lightning integration for the
standalone ``pytorch_lightning`` / ``lightning_fabric`` packages.

Those packages are Lightning's own sources with ``lightning.pytorch`` renamed ``pytorch_lightning`` and
``lightning.fabric`` renamed ``lightning_fabric``: their ``Trainer`` only accepts strategies, precision plug-ins
and callbacks that subclass *their* classes. So this package holds no code of its own: each submodule is the
module of the same name under ``fsdp_plugin.integrations.lightning``, executed from that module's source with
the same renames Lightning applies (see ``_mirror``). One implementation, two package names.

``import fsdp_plugin`` registers the name in both packages' registries (``lightning._register``); nothing here
imports either package until a Trainer or Fabric asks for ``strategy="fsdp_plugin"``.
"""
from __future__ import annotations

import importlib
from typing import Any

from fsdp_plugin.integrations.pytorch_lightning._mirror import install as _install

_install(__name__)

_LAZY = {
    "FSDPPluginStrategy": "strategy",
    "FSDPPluginFabricStrategy": "fabric",
    "FSDPPluginPrecision": "precision",
    "FSDPPluginFabricPrecision": "precision",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
