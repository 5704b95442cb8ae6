"""Latency terms of a step at cluster scale (issue 30): what the byte counts miss at 1,000 ranks.

A collective on a ring of ``n`` ranks takes ``n − 1`` sequential steps (all-gather, reduce-scatter) or
``2(n − 1)`` (all-reduce), each at least one link latency, however small the message. So per step::

    latency floor = Σ_collectives ring_steps(kind, group size) × link_latency

with the per-step collective counts of the plan (``WorldPlan.wire_calls``, the engine's own schedule), the
group of each kind from the engine's mesh rule (shard group for all-gathers and reduce-scatters; replicate
group for the all-reduces of no_shard and hybrid; the whole world for control collectives), plus what the
pairing check adds (``ShardingConfig.pairing_check``: "strict" announces every native unit collective: one
all-gather of the world each; "auto" and "off": nothing) and the status thread's store traffic
(``_comm/status.period``). NCCL's tree and LL protocols beat the ring bound on small messages, so this is a
conservative floor for NCCL and the expected cost for gloo's ring; it is independent of ``link_gbps``
pricing (bytes / bandwidth), which adds on top.
"""
from __future__ import annotations

from typing import Optional

from .._comm import status

DEFAULT_LINK_LATENCY_US = 30.0       # a small message over a datacentre TCP/IB hop, order of magnitude


def ring_steps(kind: str, n: int) -> int:
    """Sequential steps of one collective of ``kind`` on a ring of ``n`` ranks."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind in ("all_reduce", "control") else n - 1


def latency_terms(calls: dict, world: int, shard: int, replicate: int, pairing_check: str = "auto",
                  native_units: bool = True, link_latency_us: Optional[float] = None) -> dict:
    """The per-step latency terms of one world size.

    ``calls``: collectives per step by kind (``WorldPlan.wire_calls``); ``shard`` / ``replicate``: group
    sizes; ``native_units``: unit collectives are native (NCCL), so "strict" announces each of them.
    Returns counts, ring steps, the floor in seconds and the store traffic (operations per second)."""
    lat_s = (DEFAULT_LINK_LATENCY_US if link_latency_us is None else link_latency_us) * 1e-6
    group = {"all_gather": shard, "reduce_scatter": shard, "all_reduce": replicate, "control": world}
    unit_calls = sum(int(calls.get(k, 0)) for k in ("all_gather", "reduce_scatter", "all_reduce"))
    # the unused-parameter mask: one per reducing step (too small for the planner's byte counts)
    control = max(int(calls.get("control", 0)), 1 if world > 1 else 0)
    announcements = 0
    if pairing_check == "strict" and native_units and world > 1:
        announcements = unit_calls + 2          # one per native unit collective, end of forward and backward
    steps = {k: int(calls.get(k, 0)) * ring_steps(k, group[k]) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    steps["control"] = control * ring_steps("control", world)
    steps["pairing"] = announcements * ring_steps("all_gather", world)
    total_steps = sum(steps.values())
    period = status.period(world)
    per_rank = status.OPS_PER_PERIOD / period if world > 1 else 0.0
    return {
        "link_latency_us": lat_s * 1e6,
        "unit_collectives": unit_calls,
        "control_collectives": control,
        "pairing_announcements": announcements,
        "host_blocking_waits": control + announcements,
        "ring_steps": steps,
        "latency_floor_s": total_steps * lat_s,
        "store_ops_per_s_per_rank": per_rank,
        "store_ops_per_s_total": per_rank * world,
        "status_period_s": period,
    }


def describe(terms: dict) -> str:
    """One line of the plan's text: the latency floor and what it is made of."""
    return (f"latency floor {terms['latency_floor_s'] * 1e3:.1f} ms/step at {terms['link_latency_us']:.0f} us/hop "
            f"({terms['unit_collectives']} unit + {terms['control_collectives']} control collectives"
            + (f" + {terms['pairing_announcements']} announcements" if terms["pairing_announcements"] else "")
            + f", {terms['host_blocking_waits']} blocking waits; store {terms['store_ops_per_s_total']:.0f} ops/s "
              f"in total)")


def attach(worlds: dict, cfg, gpus_per_node: int, device, link_latency_us: Optional[float]) -> None:
    """Fill ``WorldPlan.latency`` of every world size of one plan (the engine's mesh rule gives the groups)."""
    from ._world import layout_for
    for w, wp in worlds.items():
        lay = layout_for(w, cfg, gpus_per_node, device)
        wp.latency = latency_terms(wp.wire_calls, w, lay.shard_size, lay.replicate_size, cfg.pairing_check,
                                   native_units=getattr(device, "type", "cuda") != "cpu",
                                   link_latency_us=link_latency_us)
