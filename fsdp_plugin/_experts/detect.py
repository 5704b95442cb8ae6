"""Which modules are experts modules, found without per-model code.

transformers 5 decorates every fused experts class with ``@use_experts_implementation``; its ``__init__`` sets
``_is_expert_parallel`` (and ``is_transposed``/``has_bias``) on the instance, and the module is called as
``experts(hidden_states, top_k_index, top_k_weights)`` with every parameter shaped ``[num_experts, ...]``. That
marker plus the shapes is the whole rule; a module that has the marker but not the shapes, or the older form
(one module per expert in a ``ModuleList``, e.g. Switch Transformers), is refused by name.
"""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError

_MARKER = "_is_expert_parallel"     # set by transformers' use_experts_implementation on every instance


def _is_marked(module: nn.Module) -> bool:
    return hasattr(module, _MARKER) and isinstance(getattr(module, "num_experts", None), int)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every fused experts module, in ``named_modules`` order."""
    found = []
    for name, m in model.named_modules():
        if not _is_marked(m):
            continue
        params = [(n, p) for n, p in m.named_parameters(recurse=False)]
        bad = [(n, tuple(p.shape)) for n, p in params if p.dim() < 2 or p.shape[0] != m.num_experts]
        if not params or bad or any(next(c.parameters(), None) is not None for c in m.children()):
            raise ConfigError(f"expert_parallel: {name!r} ({type(m).__name__}) is a transformers experts module, but "
                              f"its parameters {bad or 'in submodules'} are not all shaped [num_experts="
                              f"{m.num_experts}, ...]: the engine cannot split it by expert; drop expert_parallel")
        found.append((name, m))
    return found


def check_experts(model: nn.Module, ep: int, shard_size: int, strategy: str) -> list[tuple[str, nn.Module]]:
    """The experts modules of ``model`` for ``expert_parallel=ep`` over a shard group of ``shard_size`` ranks;
    every refusal at once, naming the fix."""
    found = experts_modules(model)
    if not found:
        per_expert = next((n for n, m in model.named_modules() if n.rsplit(".", 1)[-1].lower().endswith("experts")
                           and sum(1 for c in m.children() if next(c.parameters(), None) is not None) > 1), None)
        extra = (f"; {per_expert!r} holds one module per expert (the older per-expert form), which expert "
                 "parallelism does not route yet") if per_expert else ""
        raise ConfigError(f"expert_parallel={ep}: {type(model).__name__} has no experts module (a transformers 5 "
                          f"fused experts module, decorated with use_experts_implementation){extra}; drop "
                          "expert_parallel for this model")
    for name, m in found:
        if m.num_experts % ep:
            raise ConfigError(f"expert_parallel={ep} does not divide the {m.num_experts} experts of {name!r}: each "
                              f"rank of an EP group owns num_experts / E experts; use a divisor of {m.num_experts}")
    if shard_size % ep:
        raise ConfigError(f"expert_parallel={ep} does not divide the data-parallel shard group of {shard_size} ranks "
                          f"(sharding_strategy={strategy!r}): the experts of a layer are split over E ranks of one "
                          f"shard group; use a divisor of {shard_size}" + (
                              " (no_shard has shard groups of one rank: use full_shard or hybrid_shard)"
                              if strategy == "no_shard" else ""))
    return found
