"""``fp.shard(model, context_parallel=C)``: refuse what cannot be split, route attention through the registry,
and hook the root so that the training loop does not change (split before forward, exact loss after)."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .._comm import collectives as comm
from ..errors import ConfigError, UsageError
from . import attention
from .loss import finish_loss
from .split import check_inputs, make_layout, split_inputs

SPLITTABLE_LAYERS = ("full_attention", "sliding_attention")


def hf_model(root: nn.Module, cp: int) -> nn.Module:
    """The transformers model to split: ``root`` itself, or the one outermost PreTrainedModel inside it (a
    LightningModule, an accelerate-prepared wrapper). Its forward gets the hooks; everything around it runs
    unchanged on every rank of the CP group."""
    try:
        from transformers import PreTrainedModel
    except ImportError:    # pragma: no cover - transformers is a dependency of every CP use
        PreTrainedModel = ()
    found = [(n, m) for n, m in root.named_modules() if isinstance(m, PreTrainedModel)]
    def inside(name: str, other: str) -> bool:
        return name != other and (other == "" or name.startswith(other + "."))
    outer = [(n, m) for n, m in found if not any(inside(n, o) for o, _ in found)]
    if len(outer) != 1:
        what = "none" if not outer else ", ".join(repr(n) for n, _ in outer)
        raise ConfigError(f"context_parallel={cp}: {type(root).__name__} must be, or hold exactly one, transformers "
                          f"PreTrainedModel (found {what}): context parallel splits attention through transformers' "
                          "attention registry (AttentionInterface), so only such models can be split")
    return outer[0][1]


def refuse_unsplittable(root: nn.Module, cp: int) -> None:
    """Raise ConfigError, naming the reason, for a model whose sequence mixing context parallel would get wrong."""
    model = hf_model(root, cp)
    head = f"context_parallel={cp}: {type(model).__name__}"
    if not type(model)._can_set_attn_implementation():
        raise ConfigError(f"{head}: its attention does not go through transformers' ALL_ATTENTION_FUNCTIONS (the "
                          "test transformers applies in _can_set_attn_implementation), so it cannot be split")
    text = model.config.get_text_config()
    if text is not model.config:
        raise ConfigError(f"{head} is multimodal: its extra mask functions (bidirectional image tokens) are not "
                          "split yet; train its text model alone, or shard without context_parallel")
    kinds = set()
    for name in ("layer_types", "layers_block_type", "block_types"):
        kinds |= set(getattr(text, name, None) or ())
    bad = sorted(kinds - set(SPLITTABLE_LAYERS))
    if bad:
        raise ConfigError(f"{head} has {', '.join(map(repr, bad))} layers: they mix the sequence outside attention "
                          f"(a recurrent state, chunks) and are not split; only {SPLITTABLE_LAYERS} layers are")
    if getattr(text, "attention_chunk_size", None):
        raise ConfigError(f"{head} uses chunked attention (attention_chunk_size), which is not split yet")
    if not getattr(text, "is_causal", True):
        raise ConfigError(f"{head} has config.is_causal=False (bidirectional masks), which is not split yet")


def install(root: nn.Module, mesh, method: str = "allgather") -> None:
    """Route the model's attention to ``attention.KEY`` and hook its forward (see module docstring)."""
    model = hf_model(root, mesh.cp_size)
    attention.register()
    model.set_attn_implementation(attention.KEY)
    if model.config._attn_implementation != attention.KEY:
        raise ConfigError(f"context_parallel: {type(model).__name__} refused attn_implementation "
                          f"{attention.KEY!r}; shard it without context_parallel")
    from transformers.loss.loss_utils import ForCausalLMLoss
    causal_lm = getattr(model, "loss_function", None) is ForCausalLMLoss
    group, cp = mesh.cp_group, mesh.cp_size
    cp_rank = comm.rank_in(group)

    def pre(module, args, kwargs):
        kwargs = by_name(module, args, kwargs)
        if attention.STATE in kwargs:
            return (), kwargs
        ref = kwargs.get("input_ids")
        ref = ref if ref is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise UsageError("context_parallel: call the model with input_ids= or inputs_embeds= (the sequence to "
                             "split)")
        batch, seq = ref.shape[:2]
        check_inputs(kwargs, seq, batch)
        _same_batch(kwargs, ref, group)
        from transformers.masking_utils import find_packed_sequence_indices
        # transformers looks for packed documents only when the model runs without a KV cache
        packing = kwargs.get("position_ids") if not uses_cache(module, kwargs) else None
        layout = make_layout(group, cp, cp_rank, batch, seq, kwargs.get("attention_mask"), packing,
                             find_packed_sequence_indices, method)
        out = split_inputs(kwargs, layout, causal_lm)
        out["use_cache"] = False
        out[attention.STATE] = layout
        root._fp_cp_layout = layout        # for fp.gather_sequence on this forward's outputs
        return (), out

    def post(module, args, kwargs, output):
        if kwargs.get("labels") is None:
            return output
        return finish_loss(output, group)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)


def uses_cache(model: nn.Module, kwargs: dict) -> bool:
    """Whether one process would build a KV cache in this forward (transformers' ``merge_with_config_defaults``:
    ``use_cache`` given, else the config's, off under HF gradient checkpointing in training). With a cache,
    transformers does not detect packed documents (``masking_utils._preprocess_mask_arguments``), so neither
    does the split: the loss stays the one process would compute. The split itself always runs cache-free.
    (Shared with fp.plan, which splits a fake batch the same way: ``planner/_context.py``.)"""
    use = kwargs.get("use_cache")
    use = getattr(model.config, "use_cache", False) if use is None else use
    hf_ckpt = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    return bool(use) and not (hf_ckpt and model.training and torch.is_grad_enabled())


def by_name(module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Every argument by name (positional ones bound to the forward's signature)."""
    if not args:
        return dict(kwargs)
    sig = inspect.signature(module.forward)
    out: dict = {}
    for name, value in sig.bind_partial(*args, **kwargs).arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise UsageError("context_parallel: pass the model's inputs by keyword (input_ids=..., labels=...)")
        else:
            out[name] = value
    return out


def _same_batch(kwargs: dict, ref: torch.Tensor, group) -> None:
    """Every rank of a CP group must pass the same batch (samplers split by fp.data_parallel_rank): compare
    shapes and checksums in one small all-gather, and name the fix instead of training on mixed halves."""
    sums = [float(ref.shape[0]), float(ref.shape[1])]
    for name in ("input_ids", "labels", "attention_mask", "position_ids"):
        v = kwargs.get(name)
        sums.append(float(v.detach().double().sum()) if isinstance(v, torch.Tensor) else -1.0)
    mine = torch.tensor(sums, dtype=torch.float64, device=ref.device)
    outs = [torch.empty_like(mine) for _ in range(comm.group_size(group))]
    comm.all_gather_list(outs, mine, group, what="context-parallel batch check", kind="cp_check")
    if not all(torch.equal(o, outs[0]) for o in outs):
        raise UsageError("context_parallel: the ranks of one context-parallel group passed different batches "
                         f"(shape/checksums {[o.tolist() for o in outs]}); every rank of a CP group must pass the same "
                         "full batch: split the data by fp.data_parallel_rank(model)/fp.data_parallel_size(model), "
                         "not by the global rank")
