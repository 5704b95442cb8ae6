"""A transformers model's own tensor-parallel plan on a torch DeviceMesh, before ``fp.shard`` (issue 31).

::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = AutoModelForCausalLM.from_config(config)          # the same seed on every rank (or load after)
    parallelize_hf(model, mesh["tp"])                         # model.tp_plan ("auto") or a plan of your own
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy=...)

The plan's wildcard keys (``model.layers.*.self_attn.q_proj``) are expanded against the model's module and
parameter names, then transformers' own ``apply_tensor_parallelism`` installs its styles (DTensor
parameters, its forward transforms), so the model computes exactly as under ``from_pretrained(tp_plan=...)``.
"""
from __future__ import annotations

import re
from typing import Optional, Union

from torch import nn

from fsdp_plugin.errors import TensorParallelError


def expand_plan(model: nn.Module, plan: dict) -> dict:
    """``{pattern: style}`` to ``{module or parameter name: style}`` (``*`` matches a layer number)."""
    modules = dict(model.named_modules())
    names = [n for n in modules if n] + [n for n, _ in model.named_parameters()]
    out, derived = {}, {}
    for pattern, style in plan.items():
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        hits = [n for n in names if rx.match(n)]
        if not hits:
            raise TensorParallelError(f"tp_plan key {pattern!r} matches no module or parameter of "
                                      f"{type(model).__name__}: fix the plan (names as in model.named_modules())")
        for n in hits:
            out[n] = style
            # transformers shards parameters by their own names (its loader matches them one by one); a
            # parameter's own plan entry (packed_colwise under moe_tp_experts) wins over its module's
            for pn, p in (modules[n]._parameters.items() if n in modules else ()):
                if p is not None:
                    derived.setdefault(f"{n}.{pn}", style)
    return {**derived, **out}


def parallelize_hf(model: nn.Module, tp_mesh, plan: Union[str, dict, None] = "auto") -> nn.Module:
    """Apply ``plan`` ("auto": ``model.tp_plan``, the model's ``base_model_tp_plan`` with its head) on the 1-D
    ``tp_mesh``; returns ``model``. Call it on every rank, before ``fp.shard``."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if plan in ("auto", None):
        plan: Optional[dict] = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
        if not plan:
            raise TensorParallelError(f"{type(model).__name__} has no tp_plan: pass plan={{module pattern: style}} "
                                      "(styles: colwise, rowwise, ...) or parallelize it with torch's parallelize_module")
    return apply_tensor_parallelism(model, tp_mesh, expand_plan(model, dict(plan)))
