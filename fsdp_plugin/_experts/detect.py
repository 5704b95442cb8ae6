"""Which modules are experts modules, found without per-model code.

Two forms:

* fused (transformers 5): every fused experts class is decorated with ``@use_experts_implementation``; its
  ``__init__`` sets ``_is_expert_parallel`` (and ``is_transposed``/``has_bias``) on the instance, and the module is
  called as ``experts(hidden_states, top_k_index, top_k_weights)`` with every parameter shaped
  ``[num_experts, ...]``. That marker plus the shapes is the rule; a marked module without the shapes is refused.
* per-expert (older transformers, remote code, Switch Transformers): a child named ``*experts`` (not
  ``shared_experts``) of a block, an ``nn.ModuleList``/``nn.ModuleDict`` of two or more modules of one class with
  the same parameter names and shapes; the block's own forward routes and calls each expert on its rows
  (``per_expert.py``).
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


def _signature(m: nn.Module) -> tuple:
    return type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())


def per_expert_containers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(qualified name of the container, its block, the container)`` of every per-expert experts container."""
    found = []
    for parent_name, parent in model.named_modules():
        for attr, c in parent.named_children():
            if (not isinstance(c, (nn.ModuleList, nn.ModuleDict)) or _is_marked(c) or len(c) < 2
                    or not attr.lower().endswith("experts") or "shared" in attr.lower() or c._parameters):
                continue
            experts = list(c.children())
            if len({_signature(e) for e in experts}) != 1 or next(experts[0].parameters(), None) is None:
                continue
            name = f"{parent_name}.{attr}" if parent_name else attr
            scalars = [n for n, p in experts[0].named_parameters() if p.dim() == 0]
            if scalars:
                raise ConfigError(f"expert_parallel: the experts of {name!r} have 0-d parameters {scalars}: the engine "
                                  "cannot give them an empty box on the EP ranks that do not own them; drop "
                                  "expert_parallel")
            found.append((name, parent, c))
    return found


def check_experts(model: nn.Module, ep: int, shard_size: int, strategy: str) -> tuple[list, list]:
    """The experts of ``model`` for ``expert_parallel=ep`` over a shard group of ``shard_size`` ranks: (fused
    modules as ``(name, module)``, per-expert containers as ``(name, block, container)``); every refusal at once,
    naming the fix."""
    fused, per_expert = experts_modules(model), per_expert_containers(model)
    if not fused and not per_expert:
        raise ConfigError(f"expert_parallel={ep}: {type(model).__name__} has no experts module (a transformers 5 "
                          "fused experts module, decorated with use_experts_implementation, or a block's child named "
                          "'*experts' that is a ModuleList/ModuleDict of identical per-expert modules); drop "
                          "expert_parallel for this model")
    counts = [(n, m.num_experts) for n, m in fused] + [(n, len(c)) for n, _, c in per_expert]
    for name, count in counts:
        if count % ep:
            raise ConfigError(f"expert_parallel={ep} does not divide the {count} experts of {name!r}: each "
                              f"rank of an EP group owns num_experts / E experts; use a divisor of {count}")
    if shard_size % ep:
        raise ConfigError(f"expert_parallel={ep} does not divide the data-parallel shard group of {shard_size} ranks "
                          f"(sharding_strategy={strategy!r}): the experts of a layer are split over E ranks of one "
                          f"shard group; use a divisor of {shard_size}" + (
                              " (no_shard has shard groups of one rank: use full_shard or hybrid_shard)"
                              if strategy == "no_shard" else ""))
    return fused, per_expert
