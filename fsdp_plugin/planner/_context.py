"""``fp.plan(..., context_parallel=C)``: the fake run goes through the engine's own context-parallel code.

Measured, not derived: while the fake forward+backward runs, the model is routed exactly as ``fp.shard`` routes
it (``_context.install``): its attention is the engine's registered ``cp_attention``, and a forward pre-hook
splits the full batch with the engine's ``make_layout`` / ``split_inputs`` (CP rank 0's positions: the
head-tail layout gives every rank the same count). So the activation curve is one rank's at ``T = padded / C``
tokens, the gathered K/V (ring: the two blocks it holds), the masks and the split inputs included, and
activation checkpointing's recomputation gathers (or rotates) again as the engine does. The engine's
collectives module is swapped, inside the attention code only, for `CountingComm`: it moves nothing (fake tensors have no data) and counts every call
with ``fp.comm_stats``'s own formula, by the kind the engine gives it. The two small collectives outside
attention (the batch check, ``cp_check``; the loss sum, ``cp_loss``) are counted with the same formulas.
The split's layout is host metadata the engine reads values from (which attention tiles to compute): it is built
as real CPU tensors for a batch whose every token is valid and holds no packed documents (a fake batch's values
are unknown), and the tile plan is read outside the fake mode.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

from .. import _compat
from .._comm.stats import ring_bytes
from ..errors import ConfigError, UnsupportedError, UsageError
from .errors import PlanError

# install._same_batch all-gathers (batch, length, 4 checksums) as float64
_CHECK_VALUES = 6


class CountingComm:
    """The part of ``_comm.collectives`` the CP attention calls, on fake tensors: outputs are left as allocated
    (nothing moves), bytes and calls are counted per kind as ``fp.comm_stats`` counts them (``ring_bytes``).
    ``in_backward``: the part of ``bytes`` counted while autograd ran backward (dK/dV's reduce-scatter, and the
    K/V gathered again by activation checkpointing's recomputation); ``first``: the bytes of each kind's first
    call (one layer's forward)."""

    def __init__(self, cp: int):
        self.cp = cp
        self.bytes, self.calls, self.in_backward, self.first = Counter(), Counter(), Counter(), {}
        self.backward_calls = Counter()
        self.local_tokens = self.padded = 0

    def _count(self, kind: str, elems: int, itemsize: int, factor: int = 1, whole: bool = False) -> None:
        self.calls[kind] += 1
        n = elems * itemsize if whole else ring_bytes(elems, itemsize, self.cp, factor)
        self.bytes[kind] += n
        self.first.setdefault(kind, n)
        if _compat.in_backward():
            self.in_backward[kind] += n
            self.backward_calls[kind] += 1

    def all_gather(self, out, inp, group, async_op=False, kind="all_gather", **_):
        self._count(kind, out.numel(), out.element_size())

    def reduce_scatter(self, out, inp, group, async_op=False, **_):
        self._count("reduce_scatter", inp.numel(), inp.element_size())

    def exchange(self, out, inp, group, kind, **_):
        self._count(kind, inp.numel(), inp.element_size())

    def rotate(self, out, inp, group, kind, **_):
        """One ring step: ``inp``'s bytes sent to the next rank, as ``collectives.rotate`` counts it."""
        self._count(kind, inp.numel(), inp.element_size(), whole=True)

    def wait(self, work, *args, **kwargs) -> None:
        pass

    def group_size(self, group) -> int:
        return self.cp

    def rank_in(self, group) -> int:
        return 0

    def __getattr__(self, name):
        raise PlanError(f"fp.plan(context_parallel=...): the engine's context-parallel attention calls "
                        f"collectives.{name}, which the planner does not count yet; plan without "
                        "context_parallel and measure the attention's traffic with fp.comm_stats")


def check(cfgs: list, worlds: list, opts: dict) -> int:
    """The context-parallel size the configs share (1: off), after refusing what the planner cannot price."""
    sizes = {(c.context_parallel, c.context_parallel_attention) for c in cfgs}
    if len(sizes) > 1:
        raise PlanError(f"fp.plan: the configs planned together differ in context_parallel/attention {sorted(sizes)}; "
                        "plan each context-parallel size on its own (one fake run each)")
    cp = cfgs[0].context_parallel
    if cp == 1:
        return 1
    bad = [w for w in worlds if w % cp]
    if bad:
        raise PlanError(f"context_parallel={cp} does not divide world_size {bad}: world = data-parallel x "
                        f"context-parallel; plan world sizes that are multiples of {cp}")
    if opts.get("tp_size") not in (None, 1):
        raise PlanError(f"context_parallel={cp} with tp_size: fp.shard does not combine them yet (a DeviceMesh is "
                        "refused with context_parallel); plan one of them")
    if opts.get("nodes") is not None or opts.get("link_latency_us") is not None:
        raise PlanError(f"context_parallel={cp} with nodes=/link_latency_us=: the attention's collectives are not "
                        "placed on links yet; plan on one node (world_size and gpus_per_node) for the CP pricing")
    return cp


def check_shard(cp: int, cfg, shard_size: int, world: int) -> None:
    """fp.shard's rule (``_groups/mesh._with_context_parallel``): a shard group holds whole CP groups."""
    if cp > 1 and cfg.sharding_strategy != "no_shard" and shard_size % cp:
        raise PlanError(f"context_parallel={cp} does not divide the shard group of {shard_size} ranks at world "
                        f"{world} ({cfg.sharding_strategy}): parameters shard over shard x cp; choose a shard size "
                        f"(device_mesh, gpus_per_node) that {cp} divides")


def summary(counts, world: int) -> dict:
    """``WorldPlan.context_parallel``: what the attention moves per rank and step, and where it came from."""
    if counts is None:
        return {}
    attn = {k: v for k, v in counts.bytes.items() if k not in ("cp_check", "cp_loss")}
    return {"size": counts.cp, "attention": counts.method, "data_parallel": world // counts.cp,
            "tokens_per_rank": counts.local_tokens, "padded_length": counts.padded,
            "bytes": dict(counts.bytes), "calls": dict(counts.calls),
            "attention_bytes": sum(attn.values()), "backward_bytes": dict(counts.in_backward),
            "layer_forward_bytes": _layer_forward(counts),
            "first_call_bytes": dict(counts.first),
            "source": "measured: the engine's context-parallel attention and split on fake tensors, collectives "
                      "counted with fp.comm_stats' formula"}


def _layer_forward(counts) -> int:
    """One attention layer's forward bytes (the mean over the forward's layers): its K/V all-gather, its C−1
    ring rotations, or its 4 Ulysses all-to-alls (q, k, v in; the output back)."""
    kind, per_layer = {"ulysses": ("cp_ulysses", 4), "ring": ("cp_kv_ring", counts.cp - 1)}.get(
        counts.method, ("cp_kv", 1))
    calls = counts.calls[kind] - counts.backward_calls[kind]
    return (counts.bytes[kind] - counts.in_backward[kind]) * per_layer // calls if calls else 0


def notes(counts) -> list:
    if counts is None:
        return []
    return [f"context parallel {counts.cp} ({counts.method}): activations measured on one rank's "
            f"{counts.local_tokens} of {counts.padded} positions (padded to 2C chunks) through the engine's own "
            f"split and attention; wire bytes include its collectives (cp_kv/cp_ulysses, dK/dV in "
            f"reduce_scatter; ring: cp_kv_ring/cp_kv_ring_bwd/cp_dkv_ring; cp_check, cp_loss); parameters shard over the whole shard group (shard x cp)"]


@contextlib.contextmanager
def routed(module: nn.Module, cp: int, method: str):
    """Inside: ``module`` runs as CP rank 0 of ``cp`` would under fp.shard (see the module docstring); yields
    the `CountingComm` whose counters the run fills (None when ``cp`` is 1). Everything is restored on exit."""
    if cp == 1:
        yield None
        return
    from .._context import attention
    from .._context.install import by_name, hf_model, refuse_unsplittable
    from .._context.split import check_inputs, make_layout, split_inputs
    try:
        refuse_unsplittable(module, cp)
        model = hf_model(module, cp)
    except ConfigError as e:
        raise PlanError(str(e)) from e
    counter = CountingComm(cp)
    counter.method = method
    attention.register()
    before = model.config._attn_implementation
    model.set_attn_implementation(attention.KEY)
    from transformers.loss.loss_utils import ForCausalLMLoss
    causal_lm = getattr(model, "loss_function", None) is ForCausalLMLoss

    def pre(mod, args, kwargs):
        kwargs = by_name(mod, args, kwargs)
        ref = kwargs.get("input_ids")
        ref = ref if ref is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise PlanError("fp.plan(context_parallel=...): the inputs must call the model with input_ids= or "
                            "inputs_embeds= (the sequence the engine splits)")
        batch, seq = ref.shape[:2]
        check_inputs(kwargs, seq, batch)
        counter._count("cp_check", _CHECK_VALUES * cp, 8)          # install._same_batch
        # the layout is host metadata whose values the engine reads (which tiles to compute): built real, from
        # what a fake batch can say -- every token valid, no packed documents (their values are unknown here);
        # the fake run lets such real CPU tensors into its ops (``_fake_run``: allow_non_fake_inputs)
        with _compat.outside_fake_mode():
            mask = None if kwargs.get("attention_mask") is None else torch.ones(batch, seq, dtype=torch.long)
            layout = make_layout(None, cp, 0, batch, seq, mask, None, None, method)
        out = split_inputs(kwargs, layout, causal_lm)
        out["use_cache"] = False
        out[attention.STATE] = layout
        counter.local_tokens = int(layout.q_index.numel())
        counter.padded = layout.padded
        return (), out

    def post(mod, args, kwargs, output):
        loss = output[0] if isinstance(output, tuple) else getattr(output, "loss", None)
        if kwargs.get("labels") is not None and isinstance(loss, torch.Tensor):
            counter._count("cp_loss", loss.numel(), loss.element_size(), factor=2)    # loss.finish_loss
        return output

    hooks = [model.register_forward_pre_hook(pre, with_kwargs=True),
             model.register_forward_hook(post, with_kwargs=True)]
    from .._context import blockwise, ring
    real_comm, real_tiles = (attention.comm, blockwise.comm, ring.comm), (blockwise.plan, ring.plan)

    def tiles(*args, **kwargs):     # which tiles to compute: read from the real layout, outside the fake mode
        with _compat.outside_fake_mode():
            return real_tiles[0](*args, **kwargs)
    attention.comm = blockwise.comm = ring.comm = counter
    blockwise.plan = ring.plan = tiles
    try:
        yield counter
    except (UnsupportedError, UsageError) as e:     # the engine's own refusal of this model or batch
        raise PlanError(str(e)) from e
    finally:
        attention.comm, blockwise.comm, ring.comm = real_comm
        blockwise.plan, ring.plan = real_tiles
        for h in hooks:
            h.remove()
        model.set_attn_implementation(before)
