"""``fp.compile(model)``: ``torch.compile`` each innermost unit's ``forward``, the engine's hooks outside it.

Why per unit (as torchtitan compiles per block): the unit hooks (all-gather, view registration, reshard,
gradient reduction) run in ``nn.Module.__call__`` around ``forward`` and are Python with side effects; a
compiled region containing them would graph-break at every collective. Compiling only ``forward`` of the
units that contain no other unit keeps each compiled region pure compute over the unit's unsharded views
(passed to the graph as inputs, so a new view object each step does not recompile), while units with nested
units (usually the root: embeddings, head) stay eager.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import ShardingError


def compile(model: nn.Module, **compile_kwargs: Any) -> nn.Module:  # noqa: A001 - mirrors torch.compile
    """Compile the forward of every innermost unit of sharded ``model`` in place; return ``model``.

    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``fullgraph``...).
    Calling it again replaces the previous compilation. fp32 results match eager within float rounding.
    """
    return compile_units(model, lambda fn: torch.compile(fn, **compile_kwargs))


def compile_units(model: nn.Module, wrap: Callable[[Callable], Callable]) -> nn.Module:
    """:func:`compile` with any compiler: ``wrap(forward)`` returns the compiled forward (e.g. an existing
    ``torch._dynamo`` optimize context, as Lightning keeps it)."""
    root = getattr(model, "_fp_root", None)
    if root is None:
        raise ShardingError("fp.compile(model): the model is not sharded; call fp.shard(model, ...) first "
                            "(or torch.compile an unsharded model directly)")
    unit_modules = {id(u.module) for u in root.units}
    inner = [u.module for u in root.units
             if not any(id(d) in unit_modules for d in u.module.modules() if d is not u.module)]
    for m in inner:
        original = m.__dict__.get("_fp_eager_forward", m.forward)
        m._fp_eager_forward = original
        m.forward = wrap(original)
    return model


def compiled_units(model: nn.Module) -> list[str]:
    """Names of the units whose forward :func:`compile` compiled (for tests and logs)."""
    root = getattr(model, "_fp_root", None)
    return [u.name for u in (root.units if root is not None else ()) if "_fp_eager_forward" in u.module.__dict__]
