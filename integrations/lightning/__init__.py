"""Lightning integration: ``Trainer(strategy="fsdp_plugin")`` and ``Fabric(strategy="fsdp_plugin")``.

``import fsdp_plugin`` registers the name (see ``_register``); this package imports Lightning only when
one of the names below is accessed.
"""
from __future__ import annotations

import importlib
from typing import Any

from fsdp_plugin.integrations.lightning._register import register_if_lightning_present

_LAZY = {
    "FSDPPluginStrategy": "strategy",
    "FSDPPluginFabricStrategy": "fabric",
    "FSDPPluginPrecision": "precision",
    "FSDPPluginFabricPrecision": "precision",
    "consolidate_lightning": "convert",
}

__all__ = [
    "FSDPPluginFabricPrecision",
    "FSDPPluginFabricStrategy",
    "FSDPPluginPrecision",
    "FSDPPluginStrategy",
    "consolidate_lightning",
    "register_if_lightning_present",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_if_lightning_present()
