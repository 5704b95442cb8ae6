"""Links: price each collective at the link its group uses (``fp.plan(..., nodes=, link_gbps=, link_latency_us=)``).

Nodes are ``world / nodes`` consecutive ranks (torchrun's node-major numbering, as the engine's groups assume).
A group's placement follows from the layout: ``shard`` = S consecutive ranks, ``replicate`` = R ranks of stride S,
``secondary`` (hpZ) = r consecutive ranks of a shard group. Per rank, a collective's ring bytes split evenly over
its peers (the engine's point-to-point collectives send every peer one chunk: ``_comm/nodes.py``, the same rule
``fp.comm_stats.inter_node_bytes`` counts), so the inter-node share is ``bytes · off / (n − 1)`` with ``off`` the
group's peers on other nodes. The k ranks of a node share its link: node egress = k · inter bytes per rank,
priced at ``link_gbps`` (each direction; full duplex), plus ``calls · link_latency_us`` for every collective
that crosses it. Intra-node bytes go at the calibration's bus rate.

Step time across nodes: ``intra + compute + link − hidden · min(compute, link)``. Where collectives run beside
compute (CUDA: the calibration's ``overlap`` is 1) the link hides behind compute (prefetched all-gathers,
reduce-scatters in flight, hybrid's all-reduce overlapping backward) until it is longer: ``max(compute, link)``.
On CPU/gloo the transfers use the same cores: the testbed (benchmarks/RESULTS_lab_notes.md § 35, paired rounds at
200 Mbit/s) exposes about 45% of the link time, so ``hidden`` = 0.55 there; and (§ 35d) three costs the max()
does not see: every collective's host work (the calibration's ``latency_s``, crossing or not), the part of each
message the training thread writes into its socket itself (``ReplayResult.link_sync_bytes`` at the bus rate),
and the collectives waited with no compute since their issue (``ReplayResult.exposed_inter_bytes``: the root's
first all-gather, the reductions after backward's last kernel), which cross the link in the open:
``intra + sync + compute + exposed + rest − hidden · min(compute, rest)``, rest = link − exposed.
Priced per (kind, group) from the replay's wire bytes, so new kinds (quantized collectives) plug in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import PlanError


@dataclass(frozen=True)
class Links:
    """The node topology of a plan: ``nodes`` nodes; ``link_bytes_per_s`` per node and direction (None: no
    link pricing, bytes only); ``latency_s`` per collective crossing the link."""

    nodes: int
    link_bytes_per_s: Optional[float] = None
    latency_s: float = 0.0

    @staticmethod
    def of(nodes, link_gbps, link_latency_us) -> "Optional[Links]":
        if nodes is None and link_gbps is None:
            return None
        if nodes is None or int(nodes) < 1:
            raise PlanError(f"nodes={nodes!r}: give the number of nodes (>= 1) with link_gbps")
        if link_gbps is not None and float(link_gbps) <= 0:
            raise PlanError(f"link_gbps={link_gbps!r}: give the inter-node link rate in Gbit/s per node, e.g. 100")
        rate = float(link_gbps) * 1e9 / 8 if link_gbps is not None else None
        return Links(int(nodes), rate, float(link_latency_us or 0.0) * 1e-6)

    def per_node(self, world: int) -> int:
        if world % self.nodes:
            raise PlanError(f"world_size={world} does not split into nodes={self.nodes} equal nodes")
        return world // self.nodes


def off_node_peers(group: str, world: int, k: int, shard: int, replicate: int, secondary: int) -> tuple[int, int]:
    """(group size n, peers of a rank on other nodes) for a group of the layout, nodes of ``k`` ranks."""
    if group == "replicate":
        n = replicate
        same = max(k // shard, 1) if shard < k else 1        # ranks of the group on one node
        return n, n - min(same, n)
    n = secondary if group == "secondary" else shard
    return n, n - min(n, k)


def inter_bytes(wire_groups: dict, world: int, k: int, shard: int, replicate: int, secondary: int) -> dict:
    """Per rank and step, bytes to other nodes by kind (``fp.comm_stats.inter_node_bytes``'s rule)."""
    out: dict = {}
    for (kind, group), nbytes in wire_groups.items():
        n, off = off_node_peers(group, world, k, shard, replicate, secondary)
        if n > 1 and off:
            out[kind] = out.get(kind, 0) + nbytes * off // (n - 1)
    return out


# Share of the link time hidden behind compute on CPU/gloo, fitted on § 35's 2 × 2 small rows at 200 Mbit/s
# (step − hybrid's step against link − hybrid's link: slopes 0.43 / 0.45 / 0.56 → 0.45 exposed).
CPU_LINK_HIDDEN = 0.55


def price(links: Links, world: int, lay, res, compute_s: float, bus_bytes_per_s: float,
          latency_s: float, overlap: float = 1.0) -> dict:
    """The link-aware numbers of one world size: inter-node bytes (per rank, by kind), node egress, link and
    intra-node seconds, and the step time ``intra + max(compute, link)``."""
    k = links.per_node(world)
    inter = inter_bytes(res.wire_groups, world, k, lay.shard_size, lay.replicate_size, lay.secondary)
    crossing = sum(calls for (kind, group), calls in res.calls_groups.items()
                   if off_node_peers(group, world, k, lay.shard_size, lay.replicate_size, lay.secondary)[1])
    intra = sum(res.wire.values()) - sum(inter.values())
    egress = k * sum(inter.values())
    # every collective pays the calibration's per-call cost (measured on a tiny all-reduce: on gloo mostly the
    # host's work of posting and waiting its sends and receives), crossing the link or not; ``link_latency_us``
    # is the link's own, on top, for those that cross
    intra_s = intra / bus_bytes_per_s + sum(res.calls.values()) * latency_s
    out = {"inter_node_bytes": inter, "link_bytes_per_node": egress, "intra_s": intra_s}
    if links.link_bytes_per_s is None:
        return out
    link_s = egress / links.link_bytes_per_s + crossing * links.latency_s
    hidden = 1.0 if overlap >= 1 else CPU_LINK_HIDDEN
    # gloo/CPU: the part of each message the training thread writes into its socket itself, at the calibration's
    # bus rate (the same copy its all-gather measured), is the thread's own time: nothing hides it
    sync_s = res.link_sync_bytes / bus_bytes_per_s if overlap < 1 else 0.0
    # collectives waited with no compute since their issue (the root's first all-gather, the reductions issued
    # after backward's last kernel) cross the link in the open; the rest overlaps compute as measured
    exposed_s = min(k * res.exposed_inter_bytes / links.link_bytes_per_s, link_s) if overlap < 1 else 0.0
    rest = link_s - exposed_s
    step = intra_s + sync_s + compute_s + exposed_s + rest - hidden * min(compute_s, rest)
    return {**out, "link_s": link_s, "step_s": step, "comm_s": intra_s + link_s}
