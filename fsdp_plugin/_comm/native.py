"""Which branch a group's collectives take: gloo's point-to-point emulation, or torch's native collectives.

On gloo with CPU tensors the engine sends a unit's chunks point to point (``p2p.py``: no temporary full-size
buffer, identity tags that check pairing for free); every other backend (NCCL, torch's fake group, any custom
one) takes torch's native collectives into flat tensors and checks pairing by the ledger hash. CPU CI only has
gloo, so ``FSDP_PLUGIN_NATIVE_COLLECTIVES=1`` forces gloo through the native branch, pairing mode included: the
code every NCCL user runs executes on every CI run (tests/test_native_collectives.py). It is a test switch,
read at each decision so that a test can set it for the ranks it forks; users never need it.
"""
from __future__ import annotations

import os

import torch.distributed as dist

ENV = "FSDP_PLUGIN_NATIVE_COLLECTIVES"


def forced() -> bool:
    """Gloo takes the native branch (the test switch above)."""
    return os.environ.get(ENV, "") not in ("", "0")


def point_to_point(group) -> bool:
    """``group``'s unit collectives may use the point-to-point emulation (gloo, not forced native). The caller
    still checks that the tensors are CPU and contiguous."""
    return dist.get_backend(group) == "gloo" and not forced()


def is_fake(group=None) -> bool:
    """``group`` belongs to torch's fake process group (``init_process_group("fake", store=FakeStore())``):
    collectives return at once without moving data, so a world of any size runs in one process (memory
    estimation). Nothing of it can host a gloo side group or a rendezvous-store status thread."""
    return dist.is_initialized() and dist.get_backend(group) == "fake"
