"""``fp.plan(..., expert_parallel=E)``: the experts' own handles, the all-to-all of tokens, and the comparison
with gathering the experts whole.

Found with the engine's own rules: the experts modules are ``_experts.detect``'s, and their parameters get
their own handles of this rank's ``num_experts / E`` experts sharded over ``shard_size / E`` ranks
(``_units.discover_units``, ``_replay.Layout.n``): the replay then prices their smaller all-gathers and
reduce-scatters (none at all where ``shard_size == E``), everything else as without EP.

The all-to-alls depend on the routing, which a fake run cannot see: they are priced at **uniform routing**
(each rank sends ``(E-1)/E`` of its ``T * top_k`` rows to the other ranks of its EP group, and receives as
many), from the rows each experts call gets in the fake run (``Recorder``: tokens, ``top_k``, hidden size and
dtype, and whether the call is activation checkpointing's recomputation). Per call, as ``_experts/dispatch.py``
counts them in ``fp.comm_stats``: ``all_to_all`` = dispatch + combine forward (and their two reverses in
backward, for the calls autograd differentiates), ``all_to_all_index`` = the routes per expert (int64, one per
global expert: each rank sends the ``(E-1)/E`` of them the other ranks own). The receive buffer of one dispatch holds ``T * top_k`` rows on average and up
to ``E * T * top_k`` under the worst imbalance (every rank of the EP group routes every row to one rank).

With ``tp_size`` (EP x TP, ``_experts/layout.py``): the experts stay whole on every TP rank, so the TP plan is
applied without their entries (`tp_plan`) and the world's data-parallel part is planned at ``world / tp`` ranks
with the experts' handles over ``dp_shard / E``; each TP rank's experts call gets its dp rank's rows (the tokens
its TP group shares, the fake run's ``T``), so the all-to-alls are those of the dp world.
"""
from __future__ import annotations

import contextlib

from torch import nn

from .. import _compat
from ..errors import ConfigError
from .errors import PlanError


def check(cfgs: list, opts: dict, module: nn.Module) -> tuple:
    """``(E, {id(experts parameter): True}, [(name, experts module)])`` the configs share ((1, {}, []) when off),
    after refusing what fp.shard refuses with expert_parallel and what the planner does not price."""
    sizes = {c.expert_parallel or 1 for c in cfgs}
    if len(sizes) > 1:
        raise PlanError(f"fp.plan: the configs planned together differ in expert_parallel {sorted(sizes)}; plan "
                        "each expert-parallel size on its own")
    ep = sizes.pop()
    if ep == 1:
        return 1, {}, []
    from .._experts.detect import experts_modules, per_expert_containers
    from .._experts.layout import refuse_combinations
    try:
        for cfg in cfgs:
            refuse_combinations(cfg)
        found = experts_modules(module)
    except ConfigError as e:
        raise PlanError(str(e)) from e
    if any(c.expert_capacity_factor is not None for c in cfgs):
        raise PlanError(f"expert_parallel={ep} with expert_capacity_factor: tokens dropped over capacity are not "
                        "priced (they depend on the routing); plan it dropless (expert_capacity_factor=None), an "
                        "upper bound")
    if not found and per_expert_containers(module):
        raise PlanError(f"expert_parallel={ep}: {type(module).__name__} holds its experts per expert (a ModuleList "
                        "or ModuleDict beside the router), which fp.shard runs but fp.plan does not price yet; plan "
                        "it without expert_parallel and measure the all-to-alls with fp.comm_stats")
    if not found:
        raise PlanError(f"expert_parallel={ep}: {type(module).__name__} has no experts module (a transformers 5 fused "
                        "experts module, decorated with use_experts_implementation); plan it without expert_parallel")
    bad = [f"{n!r} ({m.num_experts})" for n, m in found if m.num_experts % ep]
    if bad:
        raise PlanError(f"expert_parallel={ep} does not divide the expert count of {', '.join(bad)}: each rank of an "
                        "EP group owns num_experts / E experts")
    for name, value in (("nodes", opts.get("nodes") is not None),
                        ("link_latency_us", opts.get("link_latency_us") is not None)):
        if value:
            raise PlanError(f"expert_parallel={ep} with {name}=: not priced yet (the all-to-alls are not placed on "
                            "links); plan on one node without it")
    if opts.get("optimizer") == "muon":
        raise PlanError(f"expert_parallel={ep} with optimizer='muon': fp.shard refuses per-tensor optimizers for "
                        "experts held per EP rank; plan with an elementwise optimizer (adamw, sgd, ...)")
    if any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in module.modules()):
        raise PlanError(f"expert_parallel={ep} with output_router_logits=True: the global aux loss's router-logits "
                        "all-gather is not priced yet; plan with output_router_logits=False")
    ids = {id(p): True for _, m in found for p in m.parameters(recurse=False)}
    return ep, ids, found


def tp_plan(module: nn.Module, found: list, plan, ep: int):
    """The TP plan EP x TP runs (``_experts/layout.refuse_tp_experts``): the experts stay whole on every TP rank.
    ``'auto'``: the model's own tp_plan minus the entries inside an experts module (and minus keys matching no
    module of this model, e.g. a dense MLP's where every layer is sparse), as the recipe passes it to
    ``parallelize_hf``; a dict with such an entry is refused by name, as fp.shard refuses it."""
    import re
    # transformers' plan keys name modules or parameters (``...experts.down_proj``: a fused experts' parameter)
    names = [n for n, _ in module.named_modules() if n] + [n for n, _ in module.named_parameters()]
    roots = [n for n, _ in found]

    def hits(key):
        rx = re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")
        return [n for n in names if rx.match(n)]

    def in_experts(n):
        return any(n == r or n.startswith(r + ".") for r in roots)
    if plan == "auto":
        own = getattr(module, "tp_plan", None) or getattr(module, "_tp_plan", None)
        if not own:
            return plan      # ``_tp`` refuses a model without a plan
        return {k: v for k, v in own.items() if hits(k) and not any(in_experts(n) for n in hits(k))}
    if isinstance(plan, dict):
        for key in plan:
            bad = [n for n in hits(key) if in_experts(n)]
            if bad:
                raise PlanError(f"expert_parallel={ep} with tensor parallel: tp_plan[{key!r}] reaches {bad[0]}; under "
                                "EP x TP the experts stay whole on every TP rank (EP splits them over the "
                                "data-parallel ranks): leave the experts' entries out of the plan, e.g. "
                                "{k: v for k, v in model.tp_plan.items() if '.experts' not in k}, or tp_plan='auto'")
    return plan


def check_shard(ep: int, shard_size: int, world: int, strategy: str) -> None:
    if ep > 1 and shard_size % ep:
        raise PlanError(f"expert_parallel={ep} does not divide the shard group of {shard_size} ranks at "
                        f"data-parallel world {world} ({strategy}): the experts of a layer are split over E ranks "
                        "of one shard group")


class Recorder:
    """Forward pre-hooks on every experts module: per call ``(rows T, top_k, hidden, itemsize of the rows,
    global expert count, recomputed)``."""

    def __init__(self, modules: list):
        self.calls: list = []
        self._hooks = [m.register_forward_pre_hook(self._record, with_kwargs=True) for _, m in modules]

    def _record(self, module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        got = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
        x, index = got["hidden_states"], got["top_k_index"]
        self.calls.append((x.numel() // x.shape[-1], index.shape[-1], x.shape[-1], x.element_size(),
                           module.num_experts, _compat.in_backward()))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@contextlib.contextmanager
def recorded(modules: list):
    """A `Recorder` on ``modules`` while inside (None when there are none)."""
    if not modules:
        yield None
        return
    rec = Recorder(modules)
    try:
        yield rec
    finally:
        rec.remove()


def all_to_all(rec: Recorder, ep: int) -> tuple[dict, dict, dict]:
    """(bytes, calls, buffer) of one rank's all-to-alls per step at uniform routing (module docstring)."""
    nbytes = {"all_to_all": 0, "all_to_all_index": 0}
    calls = {"all_to_all": 0, "all_to_all_index": 0}
    mean = worst = 0
    for tokens, k, hidden, item, experts, recomputed in rec.calls:
        rows = tokens * k
        sent = rows * (ep - 1) // ep
        ways = 2 if recomputed else 4        # dispatch + combine; their reverses in backward
        nbytes["all_to_all"] += ways * sent * hidden * item
        calls["all_to_all"] += ways
        nbytes["all_to_all_index"] += experts * 8 * (ep - 1) // ep     # ``dispatch.exchange_counts``: int64
        calls["all_to_all_index"] += 1
        mean, worst = max(mean, rows * hidden * item), max(worst, ep * rows * hidden * item)
    return nbytes, calls, {"recv_buffer_bytes": mean, "recv_buffer_worst_bytes": worst}


def expert_collectives(res, handles, lay) -> int:
    """Bytes the experts handles' own gathers and reductions move per step (the replay's counts of each one's
    gathers and reductions, at ``shard_size / E`` ranks and this rank's experts)."""
    from .._comm.collectives import ring_bytes
    total = 0
    for h, spec in enumerate(handles):
        if spec.ep == 1:
            continue
        n = lay.n(spec)
        total += res.unit_gathers.get(spec.unit, 0) * ring_bytes(spec.padded(n), lay.compute(spec).itemsize, n)
        total += res.reductions.get(h, 0) * ring_bytes(spec.padded(n), lay.reduce(spec).itemsize, n)
    return total


def summary(rec, ep: int, found: list, res, handles, lay, a2a: tuple) -> dict:
    """``WorldPlan.expert_parallel`` before the comparison (`compare`): the all-to-alls, the experts' own
    collectives and the receive buffer."""
    if rec is None:
        return {}
    nbytes, calls, buffer = a2a
    first = rec.calls[0] if rec.calls else (0, 0, 0, 0, 0, False)
    return {"size": ep, "experts_modules": len(found),
            "experts_per_rank": {n: m.num_experts // ep for n, m in found},
            "tokens_per_call": first[0], "top_k": first[1], "calls": len(rec.calls),
            "all_to_all_bytes": nbytes["all_to_all"], "all_to_all_index_bytes": nbytes["all_to_all_index"],
            "all_to_all_calls": calls["all_to_all"], "expert_collective_bytes": expert_collectives(res, handles, lay),
            **buffer,
            "source": "all-to-alls at uniform routing from the rows each experts call got in the fake run; the "
                      "experts' gathers and reductions from the replay; without EP: the same plan with "
                      "expert_parallel=None"}


_PARAM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def compare(with_ep, without) -> dict:
    """The plan with EP against the same plan without it (``WorldPlan``s of one world size): what gathering the
    experts whole costs there (the difference in parameter collectives, plus EP's own experts collectives),
    every byte of the step either way, the peaks, and whether EP moves fewer bytes."""
    dense_with = sum(with_ep.wire_bytes.get(k, 0) for k in _PARAM_KINDS)
    dense_without = sum(without.wire_bytes.get(k, 0) for k in _PARAM_KINDS)
    ep = with_ep.expert_parallel
    return {"expert_collective_bytes_without_ep": dense_without - dense_with + ep["expert_collective_bytes"],
            "wire_bytes_with_ep": with_ep.wire_total, "wire_bytes_without_ep": without.wire_total,
            "peak_without_ep": without.peak, "recommend": with_ep.wire_total < without.wire_total}


def notes(ep: int, tp: int = 1) -> list:
    if ep == 1:
        return []
    with_tp = [f"expert parallel {ep} x tensor parallel {tp}: experts whole on every TP rank, split over the EP "
               "group of one TP coordinate (its dp ranks) and sharded over dp_shard / E; each TP rank sends its dp "
               "rank's rows (the TP group's shared tokens)"] if tp > 1 else []
    return with_tp + [f"expert parallel {ep}: all-to-all bytes at uniform routing (real routing moves more or less; "
            "fp.comm_stats counts it); activations measured with the model's own experts code on this rank's rows, "
            "whose count is the same on average; the worst imbalance holds up to E x the rows (recv_buffer_worst_bytes)"]
