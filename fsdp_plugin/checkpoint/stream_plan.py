"""What :func:`fsdp_plugin.iter_full_params` yields, decided without communication.

A plan is a list of :class:`Output` s, each naming the tensors it yields (``names``, ``shapes``, ``dtypes``),
the model tensors it is made of (``sources``: keys, ``id(param)`` or ``("buffer", name)``) and how
(``make``). Each source key belongs to a *stage*: ``-1`` (plain parameters and buffers, no gather) or
the index of the unit whose all-gather produces it. An output is yielded at the last stage of its
sources, so a rank holds one unit's full buffers at a time (outputs whose sources span units keep
copies of the earlier ones until then: transformers converters of sibling modules, never the case for
the models we test).

Names: ``"module"`` = the model's own ``state_dict()`` keys (tied parameters under every name);
``"hf"`` = the names ``save_pretrained`` writes (tied parameters once, transformers' conversion mapping
applied: :mod:`.hf_convert`). PEFT LoRA models: ``merge_lora=True`` yields the base model's weights
with the active adapters merged (``W + scaling * B @ A``, PEFT's own formula, computed from the
gathered tensors: the model is never modified) under the base model's names; otherwise only the
adapter tensors, under the names PEFT saves (``"hf"``) or the module's own (``"module"``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import UnsupportedError, UsageError
from . import _model
from .hf import hf_convert
from .._flat.packed import refuse_export

NAMES = ("hf", "module")


@dataclass
class Output:
    """Tensors yielded together: ``make(sources' full tensors) -> tensors`` in ``names`` order."""

    names: list
    shapes: list
    dtypes: list
    sources: list
    make: Callable
    stage: int = -1


@dataclass
class StreamPlan:
    outputs: list = field(default_factory=list)   # in yield order (by stage)
    key_stage: dict = field(default_factory=dict)  # source key -> stage
    units: list = field(default_factory=list)      # stage -> the unit's handles
    plain: dict = field(default_factory=dict)      # stage -1: key -> tensor (unsharded parameters, buffers)
    cast_first: bool = True                        # every make() commutes with a cast: gather in the target dtype

    def meta(self) -> list[tuple[str, tuple, torch.dtype]]:
        return [(n, tuple(s), d) for o in self.outputs for n, s, d in zip(o.names, o.shapes, o.dtypes)]


def build(model: nn.Module, dtype: torch.dtype | None, names: str, merge_lora: bool) -> StreamPlan:
    if names not in NAMES:
        raise UsageError(f"names={names!r}: use names='hf' (the names save_pretrained writes, what vLLM and "
                         "SGLang load) or names='module' (the model's own state_dict keys)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"dtype={dtype!r}: pass a floating torch.dtype (e.g. torch.bfloat16), or None to keep "
                         "each tensor's own dtype")
    plan = StreamPlan(units=_model.stream_units(model))
    for stage, handles in enumerate(plan.units):
        for h in handles:
            for s in h.slots:
                plan.key_stage[id(s.param)] = stage
    entries = _entries(model)                       # (module name, key, shape, dtype), state_dict order
    plan.plain = {id(p): p.detach() for p in model.parameters() if id(p) not in plan.key_stage}
    plan.plain.update({("buffer", n): b.detach() for n, b in _model.persistent_buffers(model)})
    peft = _peft_model(model)
    if peft is not None and merge_lora:
        _merged(plan, peft, entries, names)
        plan.cast_first = False                     # W + s*B@A in the master dtype, rounded once
    elif peft is not None:
        _adapters(plan, peft, entries, names)
    else:
        _plain(plan, model, entries, names)
    refuse_export(model, "fp.iter_full_params", {k for o in plan.outputs for k in o.sources})
    for o in plan.outputs:
        o.stage = max((plan.key_stage.get(k, -1) for k in o.sources), default=-1)
        o.dtypes = [_cast(d, dtype) for d in o.dtypes]
    plan.outputs.sort(key=lambda o: o.stage)        # stable: state_dict order within a stage
    plan.outputs = _smallest_last(plan.outputs)
    return plan


def _smallest_last(outputs: list) -> list:
    """Each stage's smallest output moved to its end: the stream yields a copy of a round's last tensor, so the
    consumer's loop variable does not keep the round's buffer alive through the next gather."""
    out: list = []
    for o in outputs:
        if out and out[-1].stage != o.stage:
            _move_smallest(out)
        out.append(o)
    if out:
        _move_smallest(out)
    return out


def _move_smallest(out: list) -> None:
    stage = out[-1].stage
    first = next(i for i in range(len(out)) if out[i].stage == stage)
    size = [sum(_numel(s) for s in o.shapes) for o in out[first:]]
    out.append(out.pop(first + size.index(min(size))))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cast(d: torch.dtype, dtype) -> torch.dtype:
    return dtype if dtype is not None and d.is_floating_point else d


def _entries(model: nn.Module) -> list[tuple[str, object, tuple, torch.dtype]]:
    """Every ``state_dict()`` key of ``model``: (name, source key, full shape, dtype)."""
    shards = {id(sh.param): sh for sh in _model.param_shards(model, boxes=True)}   # global shapes
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                sh = shards.get(id(p))
                out.append((pre + name, id(p), tuple(sh.shape if sh else p.shape), p.dtype))
    for name, b in _model.persistent_buffers(model):
        out.append((name, ("buffer", name), tuple(b.shape), b.dtype))
    return out


def _one(name: str, key, shape, dt) -> Output:
    return Output([name], [shape], [dt], [key], lambda ts: ts)


def _first_names(entries) -> list:
    """Entries with each source key once (its first name: what save_pretrained writes for tied weights)."""
    seen, out = set(), []
    for e in entries:
        if e[1] not in seen:
            seen.add(e[1])
            out.append(e)
    return out


def _plain(plan: StreamPlan, model, entries, names: str) -> None:
    if names == "module":
        plan.outputs += [_one(*e) for e in entries]
        return
    _hf(plan, model, _first_names(entries))


def _hf(plan: StreamPlan, model, entries) -> None:
    """``entries`` under the names ``save_pretrained`` writes (renames one to one; converter groups)."""
    by_name = {e[0]: e for e in entries}
    renames, groups = hf_convert.plan_save(model, list(by_name))
    in_group = {n for g in groups for _, n in g.sources}
    for name, key, shape, dt in entries:
        if name not in in_group:
            plan.outputs.append(_one(renames.get(name, name), key, shape, dt))
    for g in groups:
        srcs = [n for _, n in g.sources]
        hf_convert.save_group_shapes(model, g, {n: by_name[n][2] for n in srcs}, {n: by_name[n][3] for n in srcs})
        outs = list(g.outputs)

        def make(ts, g=g, srcs=srcs, outs=outs):
            res = hf_convert.run(model, g, dict(zip(srcs, ts)))
            return [res[n].contiguous() for n in outs]
        plan.outputs.append(Output(outs, [g.outputs[n] for n in outs], [by_name[srcs[0]][3]] * len(outs),
                                   [by_name[n][1] for n in srcs], make))


# -- PEFT --------------------------------------------------------------------------------------------------------
def _peft_model(model):
    """The ``peft.PeftModel`` ``model`` is, or None (peft is only looked at when already imported)."""
    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def _lora_layers(model) -> dict[str, nn.Module]:
    """Module name -> PEFT LoRA layer (a module with ``base_layer`` and ``lora_A``)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def _base_name(name: str) -> str | None:
    """The base model's name of a PEFT model's key (TRL's rule), or None for adapter-only keys."""
    if "original_module." in name or any(t in name for t in (".lora_", "lora_magnitude_vector")):
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return name.replace(".modules_to_save.default.", ".")


def _merged(plan: StreamPlan, model, entries, names: str) -> None:
    layers = _lora_layers(model)
    key_of = {e[0]: e[1] for e in entries}
    base = []
    merges = {}
    for name, key, shape, dt in entries:
        new = _base_name(name)
        if new is None:
            continue
        layer_name = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if layer_name in layers and name.endswith(".base_layer.weight"):
            merges[key] = _merge_sources(layers[layer_name], layer_name, key_of)
        base.append((new, key, shape, dt))
    inner = model.base_model.model
    if names == "hf":
        base = _first_names(base)
    start = len(plan.outputs)
    if names == "hf":
        _hf(plan, inner, base)
    else:
        plan.outputs += [_one(*e) for e in base]
    for o in plan.outputs[start:]:
        if len(o.sources) == 1 and len(o.names) == 1 and o.sources[0] in merges:
            o.sources, o.make = merges[o.sources[0]]
        elif set(o.sources) & merges.keys():
            raise UnsupportedError(f"merge_lora=True: {o.names} are converted by transformers from several "
                                   "tensors, some with a LoRA adapter; stream the adapters (merge_lora=False)")


def _merge_sources(layer, layer_name: str, key_of: dict):
    """(source keys, make) of a LoRA layer's merged weight: ``W + sum(transpose(B @ A) * scaling)``."""
    adapters = list(layer.active_adapters)
    for a in adapters:
        if getattr(layer, "use_dora", {}).get(a) or getattr(layer, "lora_bias", {}).get(a) \
                or a not in layer.lora_A or getattr(layer, "lora_variant", {}).get(a) is not None:
            raise UnsupportedError(f"merge_lora=True: {layer_name!r} uses a LoRA variant (DoRA, lora_bias, "
                                   "an embedding or other variant) that is not merged here; stream the adapters "
                                   "(merge_lora=False) or use plain LoRA on Linear layers")
    if getattr(layer, "merged", False):
        raise UnsupportedError(f"merge_lora=True: {layer_name!r} has its adapters merged already: call "
                               "model.unmerge_adapter() first (the stream merges without touching the model)")
    keys = [key_of[f"{layer_name}.base_layer.weight"]]
    for a in adapters:
        keys += [key_of[f"{layer_name}.lora_A.{a}.weight"], key_of[f"{layer_name}.lora_B.{a}.weight"]]
    fan_in_fan_out, scaling = bool(getattr(layer, "fan_in_fan_out", False)), [layer.scaling[a] for a in adapters]

    def make(ts):
        w, out = ts[0], ts[0]
        for i, s in enumerate(scaling):
            a, b = ts[1 + 2 * i], ts[2 + 2 * i]
            half = a.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)  # PEFT's own rule
            delta = (b.float() @ a.float()) if half else b @ a
            delta = (delta.T if fan_in_fan_out else delta) * s
            out = out + delta.to(b.dtype).to(w.dtype)
        return [out]
    return keys, make


def _adapters(plan: StreamPlan, model, entries, names: str) -> None:
    """Only the adapters' tensors: PEFT's saved names (``get_peft_model_state_dict`` on meta stand-ins)."""
    if names == "module":
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        plan.outputs += [_one(*e) for e in entries if e[0] in keep]
        return
    from peft.utils import get_peft_model_state_dict

    metas = {n: torch.empty(s, dtype=d, device="meta") for n, _, s, d in entries}
    by_id = {id(t): n for n, t in metas.items()}
    entry = {e[0]: e for e in entries}
    for adapter in model.active_adapters:
        picked = get_peft_model_state_dict(model, state_dict=metas, adapter_name=adapter,
                                           save_embedding_layers=False)
        for new, t in picked.items():
            _, key, shape, dt = entry[by_id[id(t)]]
            plan.outputs.append(_one(new, key, shape, dt))
