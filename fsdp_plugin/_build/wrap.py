"""Which modules become units (auto-wrap policy), and which unit owns each parameter."""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable, Collection, Iterable

from torch import nn

from ..config import _SizePolicy
from ..errors import ConfigError
from .some_ranks_default import default_encoders


def select_unit_modules(model: nn.Module, policy, ignored: Iterable[nn.Module],
                        some_ranks: Collection[str] = ()) -> list[tuple[str, nn.Module]]:
    """Return ``[(fqn, module)]`` for every unit, root first, in module order (parents before children).

    ``some_ranks``: fqns from `some_ranks_fqns`; each is a unit and no unit is chosen inside one (its
    parameters are gathered as one piece on every rank, whatever runs inside it).
    """
    ignored_ids = {id(m) for ig in ignored for m in ig.modules()}
    candidates = [(n, m) for n, m in model.named_modules() if n and id(m) not in ignored_ids]
    if policy is None:
        chosen = _default_policy(model, candidates)
    elif isinstance(policy, _SizePolicy):
        chosen = _size_policy(model, policy.min_params, ignored_ids)
    elif isinstance(policy, (set, frozenset, tuple, list)):
        chosen = _class_policy(model, candidates, tuple(policy))
    elif callable(policy):
        chosen = {id(m) for n, m in candidates if policy(m)}
    else:
        raise ConfigError(f"auto_wrap_policy={policy!r}: use a set of module classes, a callable(module) -> bool, "
                          "fp.size_policy(min_params) or None")
    if some_ranks:
        inside = lambda n: any(n.startswith(f + ".") for f in some_ranks)
        return [("", model)] + [(n, m) for n, m in candidates if n in some_ranks or id(m) in chosen and not inside(n)]
    return [("", model)] + [(n, m) for n, m in candidates if id(m) in chosen]


# Attribute names transformers 5.24 gives modality encoders that run only on batches holding that modality
# (45 models `vision_tower`, 23 `audio_tower`, 22 `visual`, ...). `vision_model` is left out: CLIP/SigLIP-style
# models run it on every batch.
_ENCODER_NAMES = ("vision_tower", "visual", "audio_tower", "vision_encoder", "audio_encoder", "image_encoder",
                  "audio_model")


def some_ranks_hint(model: nn.Module, units) -> str:
    """A sentence for a divergence error: the modality encoders (by transformers' attribute names) that hold
    ordinary units, and the ``some_ranks_modules`` that would declare them; '' when there are none."""
    found: dict[str, str] = {}
    for u in units:
        parts = u.fqn.split(".") if u.fqn and not u.some_ranks else []
        at = next((i for i, p in enumerate(parts) if p in _ENCODER_NAMES), None)
        if at is not None:
            prefix = ".".join(parts[:at + 1])
            found.setdefault(prefix, type(model.get_submodule(prefix)).__name__)
    if not found:
        return ""
    where = ", ".join(f"{p!r} ({c})" for p, c in found.items())
    classes = ", ".join(repr(c) for c in dict.fromkeys(found.values()))
    return (f" Likely cause: {where} runs only on ranks whose batch holds that modality; declare "
            f"ShardingConfig(some_ranks_modules={{{classes}}}).")


def some_ranks_fqns(model: nn.Module, rule, ignored: Iterable[nn.Module] = ()) -> list[str]:
    """The outermost modules ``ShardingConfig.some_ranks_modules`` (``rule``) selects, by fqn, in module order;
    never the root (it runs on every rank). A rule that selects nothing is a ConfigError (a typo would
    otherwise leave the divergence it was meant to handle). None: the default (:mod:`.some_ranks_default`, a
    transformers model's vision/audio encoders); an empty collection: none."""
    ignored_ids = {id(m) for ig in ignored for m in ig.modules()}
    if rule is None:   # default: a transformers model's modality encoders (some_ranks_default)
        return default_encoders(model, _ENCODER_NAMES, ignored_ids)
    if not callable(rule) and not rule:
        return []      # some_ranks_modules=(): opted out
    if callable(rule):
        match = rule
    else:
        classes = tuple(c for c in rule if isinstance(c, type))
        names = {c for c in rule if isinstance(c, str)}
        match = lambda m: isinstance(m, classes) or type(m).__name__ in names
    found: list[str] = []
    for n, m in model.named_modules():
        if n and id(m) not in ignored_ids and not any(n.startswith(f + ".") for f in found) and match(m):
            found.append(n)
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"some_ranks_modules={rule!r} matches no submodule of {type(model).__name__}; its module "
                          f"classes are: {', '.join(present)}")
    return found


def _class_policy(model, candidates, classes) -> set:
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise ConfigError(f"auto_wrap_policy contains {bad}, which are not nn.Module classes")
    chosen = {id(m) for n, m in candidates if isinstance(m, classes)}
    if not chosen:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"auto_wrap_policy {{{', '.join(c.__name__ for c in classes)}}} matches no submodule of "
                          f"{type(model).__name__}; its module classes are: {', '.join(present)}")
    return chosen


def _default_policy(model, candidates) -> set:
    """The repeated blocks: HF ``_no_split_modules`` classes, else same-class children of a container."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return {id(m) for n, m in candidates if type(m).__name__ in names}
    chosen = set()
    for _, m in candidates:
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            kids = [c for c in m.children() if any(True for _ in c.parameters())]
            counts = Counter(type(c) for c in kids)
            chosen |= {id(c) for c in kids if counts[type(c)] >= 2}
    return chosen


def _size_policy(model, min_params: int, ignored_ids: set) -> set:
    chosen = size_selection(model, min_params, ignored_ids)
    if not chosen:
        warnings.warn(f"size_policy({min_params}) selected no submodule: the whole model is one unit, so "
                      "nothing is freed between layers; lower min_params to shard per block", stacklevel=3)
    return chosen


def size_selection(model: nn.Module, min_params: int, ignored_ids: set) -> set:
    """``id``s of the modules ``fp.size_policy(min_params)`` selects, bottom-up (torch's size-based rule): a module
    whose parameters not covered by a selected descendant reach ``min_params``; never the root."""
    chosen: set = set()

    def visit(m: nn.Module) -> int:
        """Number of parameter elements in ``m``'s subtree not yet claimed by a chosen unit."""
        total = sum(p.numel() for p in m.parameters(recurse=False))
        for child in m.children():
            if id(child) not in ignored_ids:
                total += visit(child)
        if m is not model and total >= min_params:
            chosen.add(id(m))
            return 0
        return total

    visit(model)
    return chosen


def recompute_selector(model: nn.Module, policy) -> Callable[[nn.Module], bool]:
    """``ShardingConfig.activation_checkpointing`` as a predicate on ``model``'s modules: module classes, a
    ``callable(module) -> bool``, or ``fp.size_policy(n)`` (the same bottom-up selection as auto-wrap)."""
    if isinstance(policy, _SizePolicy):
        chosen = size_selection(model, policy.min_params, set())
        return lambda m: id(m) in chosen
    if isinstance(policy, (set, frozenset, tuple, list)):
        classes = tuple(policy)
        return lambda m: isinstance(m, classes)
    return policy


def parameter_sites(model: nn.Module, ignored: Iterable[nn.Module]) -> dict[int, list]:
    """Map ``id(param)`` to every ``(module_fqn, module, attr)`` that registers it (ties included)."""
    ignored_ids = {id(m) for ig in ignored for m in ig.modules()}
    sites: dict[int, list] = {}
    seen = set()
    for fqn, m in model.named_modules(remove_duplicate=False):
        if id(m) in ignored_ids:
            continue
        for attr, p in m._parameters.items():
            if p is None or (id(m), attr) in seen:
                continue
            seen.add((id(m), attr))
            sites.setdefault(id(p), []).append((fqn, m, attr))
    return sites


def owner_unit(site_fqns: list[str], unit_fqns: list[str]) -> str:
    """The deepest unit whose subtree contains every site: the outermost unit that uses the parameter."""
    def enclosing(fqn: str) -> list[str]:
        return [u for u in unit_fqns if u == "" or fqn == u or fqn.startswith(u + ".")]

    common = set(enclosing(site_fqns[0]))
    for f in site_fqns[1:]:
        common &= set(enclosing(f))
    return max(common, key=lambda u: (u.count(".") + (1 if u else 0), len(u)))


def params_by_unit(model: nn.Module, unit_fqns: list[str], ignored: Iterable[nn.Module]) -> tuple[dict, dict, dict]:
    """Parameter ownership, the one rule fp.shard and fp.plan share: ``(sites, names, owned)`` with ``sites``
    from `parameter_sites`, ``names[id(p)]`` p's first name in ``named_parameters`` order, and
    ``owned[unit_fqn]`` the parameters each unit flattens (the `owner_unit` of their sites), in that order."""
    sites = parameter_sites(model, ignored)
    names: dict[int, str] = {}
    owned: dict[str, list] = {f: [] for f in unit_fqns}
    for n, p in model.named_parameters():
        if id(p) in sites and id(p) not in names:
            names[id(p)] = n
            owned[owner_unit([s[0] for s in sites[id(p)]], unit_fqns)].append(p)
    return sites, names, owned
