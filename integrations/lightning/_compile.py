"""``Trainer.fit(torch.compile(model))`` with ``strategy="fsdp_plugin"``: compiled per unit, not refused.

Lightning unwraps a compiled LightningModule (``from_compiled``: its ``forward`` and step methods become
dynamo-wrapped) and then refuses every strategy but single-device/DDP/FSDP. A whole-model compile would trace
the engine's hooks and collectives anyway, so for our strategy :func:`take` undoes Lightning's wrapping before
sharding and :func:`apply` compiles each innermost unit's ``forward`` with the same dynamo context
(``fp.compile``'s placement: hooks outside). :func:`allow_in_trainer` lets our strategy through the check.
Fabric re-applies ``torch.compile`` to the whole module after ``setup_module``; :func:`compile_in_fabric`
makes that step compile per unit when the module is sharded by us (other modules unchanged).
"""
from __future__ import annotations

from typing import Any

import fsdp_plugin as fp
from fsdp_plugin._build.compile import compile_units


def allow_in_trainer() -> None:
    """Let ``FSDPPluginStrategy`` pass Lightning's compiled-model strategy check (other strategies unchanged)."""
    import lightning.pytorch.trainer.trainer as trainer_mod

    check = trainer_mod._verify_strategy_supports_compile
    if getattr(check, "_fp_allows", False):
        return

    def verify(model: Any, strategy: Any) -> None:
        if getattr(strategy, "compiles_per_unit", False):
            return
        check(model, strategy)

    verify._fp_allows = True  # type: ignore[attr-defined]
    trainer_mod._verify_strategy_supports_compile = verify


def take(module: Any) -> Any:
    """The dynamo context of a LightningModule compiled via ``torch.compile`` (None if not), uncompiling it."""
    ctx = getattr(module, "_compiler_ctx", None)
    if not ctx:
        return None
    from lightning.pytorch.utilities.compile import to_uncompiled

    to_uncompiled(module)
    return ctx["dynamo_ctx"]


def apply(module: Any, dynamo_ctx: Any) -> None:
    """Compile every innermost unit's forward of sharded ``module`` with ``dynamo_ctx``."""
    if dynamo_ctx is not None:
        compile_units(module, dynamo_ctx)


def compile_in_fabric() -> None:
    """``fabric.setup(torch.compile(model))``: the re-applied compilation of our sharded module is per unit."""
    import lightning.fabric.fabric as fabric_mod

    original = fabric_mod._to_compiled
    if getattr(original, "_fp_allows", False):
        return

    def to_compiled(module: Any, compile_kwargs: dict) -> Any:
        if fp.is_sharded(module):
            return fp.compile(module, **compile_kwargs)
        return original(module, compile_kwargs)

    to_compiled._fp_allows = True  # type: ignore[attr-defined]
    fabric_mod._to_compiled = to_compiled
