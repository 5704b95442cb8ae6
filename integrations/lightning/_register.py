"""Register "fsdp_plugin" in Lightning's strategy registries without importing Lightning.

Lightning has no plug-in discovery for strategies: a name only resolves through
``lightning.pytorch.strategies.StrategyRegistry`` (Trainer) and
``lightning.fabric.strategies.STRATEGY_REGISTRY`` (Fabric), both filled when those modules execute, and the
standalone packages ``pytorch_lightning`` / ``lightning_fabric`` have registries of their own (their entries
build the same classes from ``fsdp_plugin.integrations.pytorch_lightning``).
:func:`register_if_lightning_present` (called by ``import fsdp_plugin``) therefore:

* registers at once into each registry module that is already imported, and
* for the others, installs a one-shot ``sys.meta_path`` finder that wraps the module's
  ``exec_module`` and registers right after it has executed.

Either way the import order does not matter, and neither torch nor Lightning is imported here. The
registry entries are small factories that import our strategy classes only when a Trainer or Fabric
asks for ``strategy="fsdp_plugin"``, so that importing Lightning never imports our Lightning code.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Any

STRATEGY_NAME = "fsdp_plugin"
_DESCRIPTION = "Fully sharded data parallel training with the fsdp_plugin engine (CPU/gloo and GPU/NCCL)"
_REGISTRY_ATTR = {
    "lightning.pytorch.strategies": "StrategyRegistry",
    "lightning.fabric.strategies": "STRATEGY_REGISTRY",
    # the standalone packages (``import pytorch_lightning as pl``) have registries of their own
    "pytorch_lightning.strategies": "StrategyRegistry",
    "lightning_fabric.strategies": "STRATEGY_REGISTRY",
}


def _trainer_strategy(**kwargs: Any) -> Any:
    """Registry factory for ``Trainer(strategy="fsdp_plugin")``."""
    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy

    return FSDPPluginStrategy(**kwargs)


def _fabric_strategy(**kwargs: Any) -> Any:
    """Registry factory for ``Fabric(strategy="fsdp_plugin")``."""
    from fsdp_plugin.integrations.lightning.fabric import FSDPPluginFabricStrategy

    return FSDPPluginFabricStrategy(**kwargs)


def _standalone_trainer_strategy(**kwargs: Any) -> Any:
    """Registry factory for ``pytorch_lightning.Trainer(strategy="fsdp_plugin")``."""
    from fsdp_plugin.integrations.pytorch_lightning.strategy import FSDPPluginStrategy

    return FSDPPluginStrategy(**kwargs)


def _standalone_fabric_strategy(**kwargs: Any) -> Any:
    """Registry factory for ``lightning_fabric.Fabric(strategy="fsdp_plugin")``."""
    from fsdp_plugin.integrations.pytorch_lightning.fabric import FSDPPluginFabricStrategy

    return FSDPPluginFabricStrategy(**kwargs)


_FACTORY = {"lightning.pytorch.strategies": _trainer_strategy, "lightning.fabric.strategies": _fabric_strategy,
            "pytorch_lightning.strategies": _standalone_trainer_strategy,
            "lightning_fabric.strategies": _standalone_fabric_strategy}


def _register_into(module_name: str, module: Any) -> None:
    """Add our entry to the registry that ``module`` defines (idempotent)."""
    registry = getattr(module, _REGISTRY_ATTR[module_name], None)
    if registry is not None:
        registry.register(STRATEGY_NAME, _FACTORY[module_name], description=_DESCRIPTION, override=True)


class _RegistryImportHook(importlib.abc.MetaPathFinder):
    """One-shot finder: lets the normal finders locate a registry module, then registers after it executes."""

    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = _find_with_other_finders(self, fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            _wrap_exec_module(spec.loader, fullname)
        return spec


def _find_with_other_finders(hook: Any, fullname: str, path: Any, target: Any) -> Any:
    """Ask every other meta-path finder, in order, for ``fullname``'s spec."""
    for finder in list(sys.meta_path):
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _wrap_exec_module(loader: Any, fullname: str) -> None:
    """Make ``loader.exec_module`` register our strategy once the registry module has run."""
    original = loader.exec_module

    def exec_module(module: Any) -> None:
        original(module)
        _register_into(fullname, module)

    loader.exec_module = exec_module


def register_if_lightning_present() -> None:
    """Register "fsdp_plugin" now where Lightning is imported, and on import otherwise. Cheap; idempotent."""
    pending = set()
    for name in _REGISTRY_ATTR:
        module = sys.modules.get(name)
        if module is not None:
            _register_into(name, module)
        else:
            pending.add(name)
    if any(isinstance(f, _RegistryImportHook) for f in sys.meta_path):
        for f in sys.meta_path:
            if isinstance(f, _RegistryImportHook):
                f.pending &= pending
        return
    if pending:
        sys.meta_path.insert(0, _RegistryImportHook(pending))
