"""Which peers of a collective share this rank's node: the intra-/inter-node split of ``fp.comm_stats``.

A node is ``LOCAL_WORLD_SIZE`` consecutive global ranks (torchrun numbers ranks node-major: RANK =
node_rank·nproc_per_node + local_rank); without the variable every rank is on one node. A collective of ``n``
ranks moves, per rank, ``ring_bytes`` split evenly over its ``n − 1`` peers (exact for the point-to-point gloo
collectives, where a rank sends each peer one chunk, and for a 2-rank group on any algorithm): the share of
the peers on other nodes is the rank's inter-node bytes, the rest stays inside the node (loopback / NVLink).
"""
from __future__ import annotations

import os

import torch.distributed as dist

_peers: dict = {}       # (group name, node size) -> (peers on this node, peers on other nodes)


def node_size() -> int:
    """Ranks per node (``LOCAL_WORLD_SIZE``; 0 when unset: one node of every rank)."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "0")), 0)
    except ValueError:
        return 0


def node_of(global_rank: int, per_node: int) -> int:
    return global_rank // per_node if per_node > 0 else 0


def peer_split(group) -> tuple[int, int]:
    """(peers of this rank in ``group`` on its own node, peers on other nodes); cached per group."""
    per_node = node_size()
    pg = group if group is not None else dist.group.WORLD
    key = (pg.group_name, per_node)
    split = _peers.get(key)
    if split is None:
        me = node_of(dist.get_rank(), per_node)
        ranks = [r for r in dist.get_process_group_ranks(pg) if r != dist.get_rank()]
        off = sum(node_of(r, per_node) != me for r in ranks)
        split = _peers[key] = (len(ranks) - off, off)
    return split


def is_off_node(global_rank: int) -> bool:
    """A point-to-point peer on another node."""
    per_node = node_size()
    return node_of(global_rank, per_node) != node_of(dist.get_rank(), per_node)


def forget() -> None:
    """fp.shutdown: group names may be reused by the next process group."""
    _peers.clear()
