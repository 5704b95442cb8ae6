"""Which branch a group's collectives take: gloo's point-to-point emulation, or torch's native collectives.

On gloo with CPU tensors the engine sends a unit's chunks point to point (``p2p.py``: no temporary full-size
buffer, identity tags that check pairing for free); every other backend (NCCL, torch's fake group, any custom
one) takes torch's native collectives into flat tensors and checks pairing by the ledger hash. CPU CI runs that
branch through ``nccl_sim`` (``fsdp_plugin.testing``), a backend with NCCL's completion semantics.
"""
from __future__ import annotations

import torch.distributed as dist


def point_to_point(group) -> bool:
    """``group``'s unit collectives may use the point-to-point emulation (gloo). The caller still checks that
    the tensors are CPU and contiguous."""
    return dist.get_backend(group) == "gloo"


def is_fake(group=None) -> bool:
    """``group`` belongs to torch's fake process group (``init_process_group("fake", store=FakeStore())``):
    collectives return at once without moving data, so a world of any size runs in one process (memory
    estimation). Nothing of it can host a gloo side group or a rendezvous-store status thread."""
    return dist.is_initialized() and dist.get_backend(group) == "fake"
