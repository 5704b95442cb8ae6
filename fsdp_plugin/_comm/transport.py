"""How a process group's collectives complete, decided once per group from its backend (`Transport`).

Every decision that used to re-read the backend string at each call (does this wait block the host? may the
monitor watch it? can a mismatched collective abort the process?) reads the group's `Transport` instead:

- ``BLOCKING`` (gloo): ``work.wait()`` blocks the host until the data is there, so a wait carries its deadline
  itself (``wait(timeout=)``), and a mismatched collective can abort the process (a message longer than the
  receive buffer), so its pairing must be known before it is posted (tags or announcements).
- ``STREAM`` (NCCL, ``nccl_sim``, every other backend): ``work.wait()`` only orders the current stream after the
  collective; the host runs ahead, the deadline belongs to the monitor (``deadlines.py``), and a mismatched
  collective hangs (or exchanges garbage) without taking the process down, so its pairing can be verified once
  per step (``ledger.py``).
- ``FAKE`` (torch's fake group): collectives return at once and move nothing; its works never report completion.
"""
from __future__ import annotations

import enum

import torch.distributed as dist


class Transport(enum.Enum):
    BLOCKING = "blocking"
    STREAM = "stream"
    FAKE = "fake"


def of_backend(backend: str) -> Transport:
    if backend == "gloo":
        return Transport.BLOCKING
    if backend == "fake":
        return Transport.FAKE
    return Transport.STREAM


def of_group(group=None) -> Transport:
    """``group``'s transport (None: the default group; no process group at all: gloo's, a blocking one)."""
    if not dist.is_initialized():
        return Transport.BLOCKING
    return of_backend(dist.get_backend(group))
