"""Per-module precision: what computes in float32 inside 16-bit units (`MixedPrecision.fp32_modules` and the
model's own ``_keep_in_fp32_modules``).

Two sources, two rules:

* The model's declaration, by transformers' rule (``_keep_in_fp32_modules_strict`` under fp16 and bf16,
  ``_keep_in_fp32_modules`` under fp16 only): the parameters and buffers whose qualified names match a pattern
  (``re.search``, ``*`` = any characters) stay float32, with no casts, exactly as ``from_pretrained(dtype=...)``
  leaves them; the model's code casts around them itself (T5's ``wo``, MoE routers' ``gate.weight``).
* ``fp32_modules`` (the user's): the module's parameters are float32 in forward and backward, its 16-bit
  floating inputs are cast to float32 on entry, autocast is off inside it, and its float32 outputs are cast to
  ``param_dtype`` on exit -- torch FSDP2's ``MixedPrecisionPolicy(param_dtype=float32,
  output_dtype=param_dtype)`` on that module, or by hand ``module.float()`` plus those casts -- so the 16-bit
  modules around it see 16-bit tensors. Autograd casts the gradients back through the same casts. Only the
  outermost matching modules get the casts: a module matched inside another fp32 module already runs in
  float32.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import MixedPrecision
from ..errors import ConfigError


def _pattern(entry: str) -> "re.Pattern":
    return re.compile(entry.replace("*", ".*"))


def declared_patterns(model: nn.Module, mp: Optional[MixedPrecision]) -> list:
    """The model's ``_keep_in_fp32_modules(_strict)`` patterns that apply under ``mp`` (transformers' rule)."""
    if mp is None or not mp.low_precision:
        return []
    names: list = []
    if mp.param_dtype in (torch.float16, torch.bfloat16):
        names += sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if mp.param_dtype == torch.float16:
        names += sorted(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [_pattern(n) for n in dict.fromkeys(names)]


def _declared(fqn: str, name: str, patterns: list) -> bool:
    full = f"{fqn}.{name}" if fqn else name
    return any(p.search(full) for p in patterns)


def _matches(entry, fqn: str, module: nn.Module) -> bool:
    if isinstance(entry, type):
        return isinstance(module, entry)
    if type(module).__name__ == entry:
        return True
    own = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    return any(_declared(fqn, n, [_pattern(entry)]) for n in own) or bool(fqn) and bool(_pattern(entry).search(fqn))


def fp32_regions(model: nn.Module, mp: Optional[MixedPrecision]) -> list[tuple[str, nn.Module]]:
    """The outermost modules ``mp.fp32_modules`` selects, in ``named_modules`` order ([] without 16-bit
    compute). A string that matches no module is refused (a typo would silently train in 16 bits); a class
    may be absent (torch FSDP1's default ``_module_classes_to_ignore=(_BatchNorm,)`` maps to one)."""
    if mp is None or not mp.low_precision or not mp.fp32_modules:
        return []
    named = list(model.named_modules())
    hits = {e: [m for f, m in named if _matches(e, f, m)] for e in mp.fp32_modules}
    missing = [e for e, ms in hits.items() if not ms and isinstance(e, str)]
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"MixedPrecision(fp32_modules=...) entries {missing} match no module of "
                          f"{type(model).__name__}; its module classes are: {', '.join(present)} (give a class, a "
                          "class name, or a pattern found in a module's qualified name or its parameters' names)")
    chosen = {id(m) for ms in hits.values() for m in ms}
    regions, inside = [], set()
    for fqn, m in named:
        if id(m) in chosen and id(m) not in inside:
            regions.append((fqn, m))
            inside |= {id(x) for x in m.modules()}
    return regions


def fp32_param_ids(model: nn.Module, mp: Optional[MixedPrecision], regions: list, sites: dict) -> set[int]:
    """``id``s of the parameters computed in float32: those of ``regions`` and those the model declares.
    ``sites`` (from ``wrap.parameter_sites``): a parameter registered both inside and outside an fp32 module
    (tied) cannot have one compute dtype and is refused."""
    inside = _inside(regions)
    patterns = declared_patterns(model, mp)
    ids = set()
    for pid, where in sites.items():
        flags = {id(module) in inside for _, module, _ in where}
        if flags == {True, False}:
            names = [f"{f}.{a}" if f else a for f, _, a in where]
            raise ConfigError(f"parameter {names[0]!r} is shared (tied) by fp32 and 16-bit modules ({', '.join(names)}): "
                              "add the other modules to MixedPrecision(fp32_modules=...), or untie the weights")
        if flags == {True} or any(_declared(f, a, patterns) for f, _, a in where):
            ids.add(pid)
    return ids


def fp32_buffers(model: nn.Module, mp: Optional[MixedPrecision], regions: list) -> set[tuple[int, str]]:
    """``(id(module), name)`` of the buffers that keep their dtype under ``buffer_dtype``: those of the fp32
    modules and those the model declares."""
    inside, patterns = _inside(regions), declared_patterns(model, mp)
    return {(id(m), n) for f, m in model.named_modules() for n in m._buffers
            if id(m) in inside or _declared(f, n, patterns)}


def _inside(regions: list) -> set[int]:
    return {id(x) for _, m in regions for x in m.modules()}


def install_casts(regions: list[tuple[str, nn.Module]], low: torch.dtype, device_type: str) -> Callable[[], None]:
    """Wrap each fp32 module's ``forward`` (see module doc): 16-bit inputs to float32, autocast off for
    ``device_type`` (Lightning's ``*-mixed`` and accelerate autocast the whole model, which would run the
    module's matmuls in 16 bits again), float32 outputs to ``low``. The ``forward`` is wrapped, not
    ``__call__``: a unit's hooks still gather before the casts. Returns a function that unwraps them
    (fp.plan's fake run)."""
    restore = forward_restorer([m for _, m in regions])
    for _, m in regions:
        m.forward = _fp32_forward(m.forward, low, device_type)
    return restore


def forward_restorer(modules: list[nn.Module]) -> Callable[[], None]:
    """A function that puts back each module's instance ``forward`` as it is now (none: the class's)."""
    saved = [(m, m.__dict__.get("forward")) for m in modules]

    def restore() -> None:
        for m, fwd in saved:
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = fwd
    return restore


def _fp32_forward(inner: Callable, low: torch.dtype, device_type: str) -> Callable:
    def down(x):
        return x.to(low) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        args, kwargs = tree_map(_up, (args, kwargs))
        with torch.autocast(device_type, enabled=False):
            out = inner(*args, **kwargs)
        return tree_map(down, out)
    return forward


def _up(x):
    """16-bit floating tensors to float32 (wider ones, and everything else, pass unchanged)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.element_size() < 4:
        return x.float()
    return x
