"""Full weights streamed unit by unit: :func:`iter_full_params` and :func:`full_params_meta`.

For RL post-training (push the policy to vLLM / SGLang every step) and any consumer that wants full
tensors without a full copy. Protocol per *round* (one unit, or consecutive units up to ``bucket_bytes``),
identical on every rank:

1. every rank all-gathers the round's flat parameters (master dtype) and waits for them: nothing is yielded
   while a gather is in flight, so a consumer that sends each tensor over another process group (rank 0 to
   vLLM) can never interleave with our collectives;
2. the asking ranks build and yield the round's tensors (full-shape views of the gathered buffer, or a cast
   copy); the others yield nothing;
3. every rank reaches one control all-reduce, *the agreement*: ``MIN`` over ``rank if this rank failed else
   world``. A rank whose consumer raised (or stopped early, or whose producer failed) enters it from the
   generator's ``GeneratorExit``/except path; the others then raise :class:`CollectiveError` naming the rank
   and the unit. The agreement waits at most the model's ``timeout_s`` (a consumer slower than that is a
   stall).

Memory: the round's full buffers (a tensor-parallel model's TP slots also as their global tensors, gathered
over TP), in ``dtype`` when one is given (the shard is cast before the all-gather: same values, half the bytes
for bf16), else in the master dtype; merged LoRA outputs are computed in
the master dtype and cast after (one cast tensor more). The buffer is dropped at the agreement (a tensor the
consumer keeps holds its buffer). Outputs whose sources lie in several rounds (rare:
transformers converters of sibling modules) keep copies of the earlier sources until their last round.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm, failure
from ..errors import CollectiveError, UsageError
from . import _comm, _model
from .stream_plan import StreamPlan, build


def full_params_meta(model: nn.Module, dtype: torch.dtype | None = None, names: str = "hf",
                     merge_lora: bool = False) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor :func:`iter_full_params` yields, in yield order.

    No communication (call it on one rank only, e.g. to tell an inference engine what to allocate)."""
    return build(model, dtype, names, merge_lora).meta()


def iter_full_params(model: nn.Module, dtype: torch.dtype | None = None, names: str = "hf",
                     merge_lora: bool = False, bucket_bytes: int | None = None,
                     ranks: Iterable[int] | str = (0,)) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for the whole model, one unit at a time, on the ranks in ``ranks``.

    Collective: every rank iterates it to the end (on ranks not in ``ranks`` the loop body never runs).
    ``ranks``: ``(0,)`` (default), any ranks, or ``"all"``. ``names``: ``"hf"`` (what ``save_pretrained``
    writes: tied weights once, transformers' conversions applied) or ``"module"`` (``state_dict()`` keys).
    ``dtype``: floating tensors cast to it. ``merge_lora``: for a PEFT LoRA model, the base weights with
    the adapters merged (the model is not modified); else the adapter tensors only. ``bucket_bytes``:
    consecutive units are gathered together up to this many full bytes (fewer agreements; peak = the
    bucket); None gathers one unit at a time. Tensors live on the compute device; they stay valid (each
    holds its unit's gathered buffer while referenced). Iterate in a ``for`` loop (or
    ``contextlib.closing``): a consumer error then ends the iteration on every rank.
    """
    failure.refuse("fp.iter_full_params")
    plan = build(model, dtype, names, merge_lora)
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise UsageError(f"bucket_bytes={bucket_bytes!r}: pass a positive number of bytes, or None for one "
                         "unit at a time")
    rank, world = _comm.rank(), _comm.world_size()
    if ranks == "all":
        mine = True
    elif isinstance(ranks, str) or not all(isinstance(r, int) and 0 <= r < world for r in ranks):
        raise UsageError(f"ranks={ranks!r}: pass 'all' or ranks in [0, {world}) (default (0,): rank 0)")
    else:
        mine = rank in set(ranks)
    timeout = _model.sharding_timeout(model)
    return _run(plan, _rounds(plan, bucket_bytes), mine, dtype, rank, world, timeout)


def _rounds(plan: StreamPlan, bucket_bytes: int | None) -> list[list[int]]:
    """Stages gathered together: ``[-1]`` (no gather) first, then units, merged up to ``bucket_bytes``."""
    rounds, size = [[-1]], None
    for stage, handles in enumerate(plan.units):
        nbytes = sum(h.padded * h.dtype.itemsize for h in handles)
        if bucket_bytes is None or size is None or size + nbytes > bucket_bytes:
            rounds.append([stage])
            size = nbytes
        else:
            rounds[-1].append(stage)
            size += nbytes
    return rounds


def _label(plan: StreamPlan, stages: list[int]) -> str:
    names = [s.fqn.rsplit(".", 1)[0] for st in stages if st >= 0 for h in plan.units[st] for s in h.slots[:1]]
    return f"the unit holding {names[0]!r}" if names else "the unsharded parameters and buffers"


def _agree(failed: bool, rank: int, world: int, timeout) -> int:
    """The lowest rank that failed (``world`` if none). Collective over every rank (control all-reduce)."""
    if world == 1:
        return rank if failed else world
    t = torch.tensor([rank if failed else world], dtype=torch.int64, device=comm.device())
    comm.all_reduce(t, None, op=dist.ReduceOp.MIN, kind="control",
                    what="iter_full_params: agreeing every rank consumed the unit", timeout_s=timeout)
    return int(t.item())


def _run(plan: StreamPlan, rounds, mine: bool, dtype, rank: int, world: int, timeout):
    later = _kept_keys(plan)
    kept: dict = {}
    by_stage: dict[int, list] = {}
    for o in plan.outputs:
        by_stage.setdefault(o.stage, []).append(o)
    for stages in rounds:
        what = _label(plan, stages)
        failed = True
        try:
            avail = _gather(plan, stages, kept, later, dtype if plan.cast_first else None)
            items = _items(by_stage, stages, avail, dtype) if mine else iter(())
            del avail
            item = next(items, None)
            while item is not None:
                after = next(items, None)
                if after is None:   # a copy: the loop variable must not keep the round's buffer alive
                    item = (item[0], item[1].clone() if item[1]._base is not None else item[1])
                yield item
                item = after
            failed = False
        finally:
            # GeneratorExit (consumer raised or stopped), a producer error, or success: every rank agrees here.
            first = _agree(failed, rank, world, timeout)
        if first < world:
            raise CollectiveError(f"iter_full_params: rank {first} stopped while streaming {what} (its consumer "
                                  "raised or left the loop, or building a tensor failed; see that rank's "
                                  "error): every rank stops here")


def _items(by_stage: dict, stages: list[int], avail: dict, dtype):
    """The round's ``(name, tensor)`` pairs, built one output at a time."""
    for stage in stages:
        for o in by_stage.get(stage, []):
            tensors = o.make([avail[k] for k in o.sources])
            for name, t in zip(o.names, tensors):
                yield name, _cast(t, dtype)


def _kept_keys(plan: StreamPlan) -> set:
    """Source keys needed by an output at a later stage than their own: copied out of their buffer."""
    return {k for o in plan.outputs for k in o.sources if plan.key_stage.get(k, -1) < o.stage}


def _gather(plan: StreamPlan, stages: list[int], kept: dict, later: set, dtype) -> dict:
    """Source key -> full tensor for this round (gathered in ``dtype`` when given, waited for) plus the kept
    earlier ones."""
    avail = dict(kept)
    for stage in stages:
        if stage < 0:
            avail.update(plan.plain)
            continue
        for h in plan.units[stage]:
            full = _model.gather_full(h, dtype)
            for s, v in zip(h.slots, _model.full_views(h, full)):    # TP slots: all-gathered over TP too
                avail[id(s.param)] = v
    for k in later:
        if k in avail and k not in kept:
            kept[k] = avail[k].clone()
    return avail


def _cast(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t
