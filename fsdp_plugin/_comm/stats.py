"""Process-wide communication counters: calls and per-rank ring bytes by kind (split intra/inter node), and
host-blocking cross-rank waits (``fp.comm_stats`` / ``fp.sync_stats``). ``collectives`` counts every call here."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from . import nodes


@dataclass
class CommStats:
    """Process-wide counters: ``calls[kind]`` and ``bytes[kind]`` (per-rank ring bytes), and ``bytes[kind]`` split
    by where the peers are (``_comm/nodes.py``): ``intra_node_bytes[kind]`` to ranks of this rank's node,
    ``inter_node_bytes[kind]`` to ranks of other nodes (the two sum to ``bytes[kind]``)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    intra_node_bytes: Counter = field(default_factory=Counter)
    inter_node_bytes: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        for counter in (self.calls, self.bytes, self.intra_node_bytes, self.inter_node_bytes):
            counter.clear()

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes),
                "intra_node_bytes": dict(self.intra_node_bytes), "inter_node_bytes": dict(self.inter_node_bytes)}


STATS = CommStats()


@dataclass
class SyncStats:
    """Process-wide count of host-blocking cross-rank waits that are not the step's data (issue 30), by the
    kind of what was waited: ``control`` (the unused-parameter mask, Join, clip_grad_norm_...), ``pairing``
    (an announcement waited before a collective may go: ``pairing_check="strict"``), ``barrier``. The host
    waiting for a data collective it issued (a CPU reduce-scatter's wait) is not counted: that wait is the
    transfer, not a meeting point added by the engine."""

    waits: Counter = field(default_factory=Counter)
    # issue 48, by backend: ``timed`` waits passed a deadline to the backend's own ``wait(timeout=)`` (on NCCL
    # each blocks the host until the GPU has finished: the engine makes none on a backend other than gloo);
    # ``host`` waits polled a collective to completion on purpose (a value the host reads at once: checkpoint
    # metadata, Join's counts; never inside a step on a device)
    timed: Counter = field(default_factory=Counter)
    host: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        for counter in (self.waits, self.timed, self.host):
            counter.clear()

    def snapshot(self) -> dict:
        return {"waits": dict(self.waits), "timed": dict(self.timed), "host": dict(self.host)}


SYNC = SyncStats()
_SYNC_KINDS = frozenset({"control", "pairing", "barrier"})


def ring_bytes(total_elems: int, elem_size: int, n: int, factor: int = 1) -> int:
    """Per-rank bytes on a ring of ``n`` ranks for a collective over ``total_elems`` elements (the counters'
    formula; fp.plan predicts traffic with it too)."""
    return factor * total_elems * elem_size * (n - 1) // n


def _count(kind: str, total_elems: int, elem_size: int, n: int, factor: int = 1, group=None) -> None:
    STATS.calls[kind] += 1
    total = ring_bytes(total_elems, elem_size, n, factor)
    STATS.bytes[kind] += total
    if n > 1:
        _split(kind, total, factor * total_elems * elem_size * nodes.peer_split(group)[1] // n)


def _split(kind: str, total: int, inter: int) -> None:
    """``total`` bytes of ``kind``, ``inter`` of them to other nodes (``_comm/nodes.py``)."""
    STATS.inter_node_bytes[kind] += inter
    STATS.intra_node_bytes[kind] += total - inter
