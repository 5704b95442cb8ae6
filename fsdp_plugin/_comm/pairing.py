"""Collective pairing by announcements: every rank enters the same unit's collective, at every step (issue 26).
Used where some unit collective is native (NCCL, no_shard's and hybrid's all-reduces); a mesh whose unit
collectives are all gloo point to point is checked by their tags instead (``tagged.py``: no message at all).

Collectives pair by issue order alone. A unit that runs on some ranks only (a branch on the rank's data, a unit
whose output misses the loss on one rank) would pair one unit's all-gather with another's: gloo aborts the
process (a message longer than the receive buffer) and NCCL exchanges the wrong data when the sizes agree.

Every per-unit data collective is therefore **announced**: each rank all-gathers one int64 (``code``: what it
enters, for which unit) on the pairing group, asynchronously (`Gate`). The data collective is bound to its
gate, and the transport decides when the verdict must be known:

- **gated** (gloo, CPU: the point-to-point collectives of ``collectives.py``, hybrid's reduce-scatter): the data's sends and receives
  are posted by the gate's completion callback, and only when every rank announced the same code, with a tag
  taken from the gate's sequence number. A mismatched data message is never sent, so gloo never sees one, and
  the check costs no new meeting point: it overlaps whatever the rank does until the data's wait, which reads
  the verdict (``CollectiveError`` on a mismatch).
- **ungated** (native collectives: NCCL, gloo's own all-reduce of no_shard): the gate is waited on the host
  right before the collective is issued (a kernel cannot be enqueued conditionally), so a mismatched
  collective is never issued either. On NCCL the gate is a gloo CPU collective: a host round trip, no device
  synchronization.

Where a rank's per-unit collectives may end early (end of the root's forward, end of backward) it waits an
announcement of an end sentinel (`agree`). Sound by construction: pairing-group collectives are all the same
(one int64 per rank), so the i-th announcement of every rank pairs with the i-th of every other, whatever
each rank does; at the first divergence every rank's announcement at that position sees the same mismatch
and no data collective of it is sent. Ranks may have issued different numbers of announcements by the time
they raise; ``fp.reset`` re-aligns them (`realign`) before it cleans up.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from ..errors import CollectiveError
from . import collectives as comm, divergence
from .divergence import Entering, abandoning, describe, divergence_message  # noqa: F401 - this module's API


_UNIT_BITS = 32
_TAG_SPAN = 1 << 20     # gated point-to-point tags: sequence numbers modulo this (far more than are ever in flight)


class _State:
    seq = 0                      # pairing-group collectives issued by this process (the same on every rank)
    diverged = False             # a gate reported a mismatch: fp.reset must realign before cleaning up


def code(entering: Entering, unit_index: int = 0) -> int:
    return (int(entering) << _UNIT_BITS) | unit_index


class Gate:
    """One announcement: this rank's ``code`` all-gathered asynchronously on the pairing ``group``.

    ``seq``: its position among pairing-group collectives (the same on every rank), from which a gated data
    collective takes its tag. ``timeout_s``: the deadline of ``wait``. ``prompt``: the bound collective is
    waited right away, so ``wait`` posts it and no completion callback is registered (a Python call on gloo's
    thread and a GIL hand-off saved where they could not overlap anything). ``hint``: the end of a divergence
    message (the model's likely cause, the same on every rank)."""

    def __init__(self, c: int, units: Sequence, group, world_size: int, timeout_s: Optional[float],
                 prompt: bool = False, hint: str = ""):
        self.code, self._units, self._timeout_s, self._prompt, self._hint = c, units, timeout_s, prompt, hint
        self.seq, _State.seq = _State.seq, _State.seq + 1
        self._everyone = torch.empty(world_size, dtype=torch.int64)
        self._work, self._future = comm.announce(self._everyone, torch.tensor([c], dtype=torch.int64), group)
        self._after = None           # the future of the ``then`` callback
        self._post: Optional[Callable[[], None]] = None   # what ``then`` posts, until claimed
        self._claim = threading.Lock()
        self._seen: Optional[list] = None

    @property
    def tag(self) -> int:
        """The point-to-point tag of the data collective bound to this gate (``p2p._GATED_TAG_BASE`` +)."""
        return self.seq % _TAG_SPAN

    def then(self, post: Callable[[], None]) -> None:
        """Call ``post`` once every rank announced this gate's code, never otherwise: from gloo's thread when
        the announcement completes (not for a ``prompt`` gate), or from ``wait`` if that comes first (no thread
        hop when the data is waited right away). Exactly once either way (``_claim``)."""
        self._post = post
        if self._prompt:
            return

        def on_done(fut):
            fut.value()              # a failed all-gather: nothing is posted, ``wait`` reports the failure
            self._post_if_agreed()
        self._after = self._future.then(on_done)

    def _post_if_agreed(self) -> bool:
        """Post the bound collective if nobody did yet and every rank agreed; True if this call claimed it."""
        with self._claim:
            post, self._post = self._post, None
        if post is not None and all(s == self.code for s in self._everyone.tolist()):
            post()
        return post is not None

    def wait(self, what: str) -> bool:
        """Block until the verdict is known: True when every rank announced this code; else a CollectiveError
        naming every rank's announcement (False instead, quietly, while fp.reset abandons the step)."""
        if self._seen is None:
            comm.wait(self._work, f"pairing check before {what}", comm.default_timeout_s(self._timeout_s))
            if not self._post_if_agreed() and self._after is not None:
                self._after.wait()   # gloo's thread claimed the posting: let it finish before the data's wait
            self._seen = self._everyone.tolist()
        if all(s == self.code for s in self._seen):
            return True
        _State.diverged = True
        if divergence.is_abandoning():
            return False
        raise CollectiveError(_divergence_message(self._seen, self._units) + self._hint)


def _divergence_message(seen: list, units: Sequence) -> str:
    return divergence_message("; ".join(f"rank {r}: {describe(s, units)}" for r, s in enumerate(seen)))


def agree(c: int, units: Sequence, group, world_size: int, timeout_s: Optional[float], hint: str = "") -> None:
    """Blocking: every rank of ``group`` (``world_size`` ranks) announces the same code ``c``, else a
    CollectiveError on every rank naming each rank's next collective (``describe`` over ``units``) and ending
    with ``hint``."""
    Gate(c, units, group, world_size, timeout_s, prompt=True, hint=hint).wait(describe(c, units))


def diverged() -> bool:
    return _State.diverged


def realign(units: Sequence, group, world_size: int, timeout_s: Optional[float], limit: int = 1 << 16) -> None:
    """After a divergence (fp.reset, every rank): announce REALIGN until every rank does at the same position.

    Each REALIGN pairs with whatever another rank still has in flight (announcements issued after the
    divergence: mismatched, so their data is never sent), so all ranks leave at the same sequence number
    with nothing of the pairing group in flight."""
    c = code(Entering.REALIGN)
    with abandoning():
        for _ in range(limit):
            gate = Gate(c, units, group, world_size, timeout_s)
            if gate.wait("fp.reset"):
                _State.diverged = False
                return
    raise CollectiveError(f"fp.reset: the ranks' pairing checks did not re-align within {limit} announcements; "
                          "restart the process group")
