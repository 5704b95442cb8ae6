"""The point-to-point collectives of gloo with CPU tensors, and the pairing gates they are bound to.

A collective here is sends and receives to every peer of its group (gloo's own all-gather and reduce-scatter
copy through a full-size temporary, its reduce-scatter moves twice the ring bytes, and its all-reduce aborts the
process on a size mismatch), waited like a torch Work. `collectives` (the only module that talks to
torch.distributed collectives) chooses them, counts their bytes and wraps their waits; under identity tags
(``Tagged``) their tags carry the pairing check (``_comm/tagged.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _compat

from . import tagged

class _Bound:
    """A gate and the name of the collective bound to it (the deadline message of the gate's wait)."""

    __slots__ = ("gate", "what")

    def __init__(self, gate, what: str):
        self.gate, self.what = gate, what

    @staticmethod
    def of(gate, what: str) -> "Optional[_Bound]":
        if isinstance(gate, Recorded):       # the ledger hash checks it at the end of the step: nothing bound
            tagged.mark(gate.code)
            return None
        return _Bound(gate, what) if gate is not None else None

    @property
    def tagged(self) -> bool:
        return isinstance(self.gate, Tagged)


class Tagged:
    """The pairing of a collective on a mesh whose unit collectives are all point to point (``_comm/tagged.py``):
    its ``code`` goes into its tag; no announcement."""

    __slots__ = ("code",)

    def __init__(self, code: int):
        self.code = code


class Recorded(Tagged):
    """The pairing of a collective checked by the ledger hash (``_comm/ledger.py``, ``pairing_check="auto"``
    where tags do not apply, e.g. NCCL): its code goes into the ledger only; nothing is sent or waited here."""

    __slots__ = ()


_P2P_TAG_BASE = 1 << 20          # above the tags of plain send/recv (0); one tag per collective of a group
_GATED_TAG_BASE = 2 << 20        # gated collectives: + their gate's tag (pairing sequence number, < 1 << 20)
_p2p_tags: dict = {}              # group name -> ungated collectives issued (names, not groups: no reference kept)


class _P2PWork:
    """A collective as sends and receives to every peer of ``group`` (gloo, CPU), waited like a torch Work.

    Per rank it writes ``chunk·(N−1)`` bytes, the ring formula of the counters. Every rank of a group issues its
    collectives in the same order (the contract of any collective), so a per-group counter gives matching tags;
    the tag keeps two collectives in flight between the same ranks apart. A gated collective (``bound``) takes
    its tag from its pairing gate and is posted by the gate's callback once every rank announced the same
    collective, so mismatched messages are never sent (``_comm/pairing.py``)."""

    def __init__(self, group, me: int, sends: list, recvs: list, bound: Optional[_Bound] = None):
        """``me``: this rank in ``group``; ``sends[j]`` / ``recvs[j]``: the tensor for group rank ``j``."""
        # The process group's own send/recv take group ranks and skip dist.isend's Python checks (they cost
        # more than the call itself at a few dozen calls per step).
        pg = group if group is not None else _compat.default_group()
        self.me, self.bound = me, bound
        self.works = []
        self.done = False
        self.fp_op = None        # set by status.issued: this collective's number, for deadline reports
        if bound is not None and bound.tagged:
            self._post_tagged(pg, bound.gate.code, sends, recvs)
            return
        if bound is not None:
            tag = _GATED_TAG_BASE + bound.gate.tag
            bound.gate.then(lambda: self._post(pg, tag, sends, recvs))
            return
        key = pg.group_name      # holding the group itself would keep it alive past fp.shutdown
        tag = _P2P_TAG_BASE + _p2p_tags.get(key, 0)
        _p2p_tags[key] = (_p2p_tags.get(key, 0) + 1) % _P2P_TAG_BASE
        self._post(pg, tag, sends, recvs)

    def _post(self, pg, tag: int, sends: list, recvs: list) -> None:
        self.works = [w for j in range(len(sends)) if j != self.me
                      for w in (pg.recv([recvs[j]], j, tag), pg.send([sends[j]], j, tag))]

    def _post_tagged(self, pg, code: int, sends: list, recvs: list) -> None:
        """Posted now, under a tag naming the collective (``tagged.issue``): the status thread finds a divergence."""
        self.pg, self.group_name, self.fp_code = pg, pg.group_name, code
        tag = tagged.issue(code, self)
        # what a peer must complement after a divergence, expanded by the status thread (``tagged.snapshot``):
        # per group rank, the bytes this rank sends to it and receives from it
        self.fp_tag = tag
        self.fp_nbytes = [(_nbytes(sends[j]), _nbytes(recvs[j])) if j != self.me else (0, 0)
                          for j in range(len(sends))]
        self._post(pg, tag, sends, recvs)

    def wait(self, timeout=None) -> bool:
        if self.bound is not None and self.bound.tagged:
            return self._wait_tagged(timeout)
        if self.bound is not None and not self.done and not self.bound.gate.wait(self.bound.what):
            self.done, self.works = True, []   # fp.reset after a divergence: nothing was sent, nothing to wait
            return True
        for w in self.works:
            if (w.wait(timeout) if timeout is not None else w.wait()) is False:
                return False
        if not self.done:
            self.done, self.works = True, []
            self._finish()
        return True

    def _wait_tagged(self, timeout) -> bool:
        if self.done:
            return True
        tagged.before_wait()
        try:
            for w in self.works:     # each gloo work waited once: a second wait of a finished one never returns
                if (w.wait(timeout) if timeout is not None else w.wait()) is False:
                    return False
        finally:
            self.done, self.works = True, []
            tagged.finished(self)
        tagged.after_wait()          # the scratch of a complement is never taken for data
        self._finish()
        return True

    def _finish(self) -> None:
        pass


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return t.numel() * t.element_size() if t is not None else 0


class _P2PAllGather(_P2PWork):
    """Rank ``r`` copies its chunk into ``out`` chunk ``r`` and receives every peer's chunk in place."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group, n: int, bound: Optional[_Bound] = None):
        me = dist.get_rank(group)
        chunks = out.view(n, -1)
        chunks[me].copy_(inp.view(-1))
        super().__init__(group, me, [inp.view(-1)] * n, list(chunks), bound)
        self.keep = inp


class _P2PReduceScatter(_P2PWork):
    """Rank ``r`` sends chunk ``j`` of its input to rank ``j``, receives every peer's chunk ``r`` and, in ``wait``,
    sums them in rank order into ``out`` (at N = 2 bit-equal to an all-reduce's sum: one commutative addition).
    No copy of the input."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group, n: int, bound: Optional[_Bound] = None):
        me = dist.get_rank(group)
        self.out, self.chunks = out, inp.view(n, -1)
        recv = list(torch.empty((n - 1, out.numel()), dtype=inp.dtype))
        self.recvs = recv[:me] + [None] + recv[me:]
        super().__init__(group, me, list(self.chunks), self.recvs, bound)
        self.keep = inp

    def _finish(self) -> None:
        parts = [self.chunks[j] if j == self.me else self.recvs[j] for j in range(len(self.chunks))]
        if len(parts) == 1:
            self.out.copy_(parts[0])
        else:
            torch.add(parts[0], parts[1], out=self.out)
        for p in parts[2:]:
            self.out.add_(p)
        self.recvs = self.chunks = self.keep = None


class _P2PAllReduce(_P2PWork):
    """A unit's reduction on gloo/CPU under identity tags (no_shard, hybrid's replicas): native gloo aborts the
    process on a size mismatch, so it is tagged point to point instead, at the ring's bytes (``2·total·(N−1)/N``,
    as the counters say) and the ring's arithmetic: each rank sums 1/N of the tensor, as gloo's own ring does.

    Above two ranks (two: ``_P2PPairSum``). Phase 1 (posted now) sends part ``j`` (near-equal parts,
    ``tensor_split``) to rank ``j``, which sums every rank's part. Phase 2 sends the summed part to every peer. Its tagged position is
    reserved and its receives posted here, with phase 1's: a peer's summed part can only arrive after that peer
    received this rank's part ``j`` from the same memory, so receiving into it never races the send. Its sends
    go out at ``advance`` (the reduction queue calls it a unit later, so phase 2 overlaps the rest of backward)
    or at ``wait``; after a divergence, at ``fp.reset`` (``tagged.drain``), so no peer waits for them."""

    def __init__(self, t: torch.Tensor, group, n: int, bound: _Bound):
        me = dist.get_rank(group)
        self.t, self.n = t, n
        self.parts = list(torch.tensor_split(t.view(-1), n))
        mine = self.parts[me]
        self.recvs = [torch.empty_like(mine) if j != me else None for j in range(n)]
        super().__init__(group, me, self.parts, self.recvs, bound)
        self.phase2 = _Phase2(self.pg, me, self.parts, bound.gate.code)

    def advance(self, timeout=None) -> bool:
        """Phase 1 waited, this rank's part summed, phase 2's sends posted; nothing waits for a peer's sum."""
        try:
            return self._wait_tagged(timeout)
        finally:
            self.phase2.post_sends()       # even when the wait raised a verdict: a peer may be waiting for them

    def wait(self, timeout=None) -> bool:
        return self.advance(timeout) and self.phase2.wait(timeout)

    def _finish(self) -> None:
        recvs, self.recvs = self.recvs, None
        if tagged.diverged():    # fp.reset after a divergence: phase 1 may hold a complement's scratch
            return
        me, parts, n = self.me, self.parts, self.n
        # rank order, ((c0 + c1) + c2) + ...: accumulate into rank 0's part (ours, or the buffer it came in)
        acc = parts[0] if me == 0 else recvs[0]
        for j in range(1, n):
            acc.add_(parts[me] if j == me else recvs[j])
        if me != 0:
            parts[me].copy_(acc)


class _P2PPairSum(_P2PWork):
    """A unit's reduction over a group of two under identity tags (no_shard at world 2, hybrid's replica pair):
    each rank sends its whole tensor to the other and adds the peer's in ``wait``. One tagged message each way
    where the ring's two phases are two each way with a wait between them (each message also costs gloo a
    ready handshake, measured: RESULTS § 30f); the ring's bytes (``total`` per rank at N = 2); and the same
    bits on both ranks (one commutative addition). The price: the peer's whole tensor is received into a
    buffer (the ring's is half) and added on each rank (the ring adds half)."""

    def __init__(self, t: torch.Tensor, group, bound: _Bound):
        me = dist.get_rank(group)
        self.t = t.view(-1)
        self.recv = torch.empty_like(self.t)
        super().__init__(group, me, [self.t, self.t], [self.recv, self.recv], bound)

    def _finish(self) -> None:
        recv, self.recv = self.recv, None
        if not tagged.diverged():    # after a divergence the buffer may hold a complement's scratch
            self.t.add_(recv)


class _Phase2:
    """Phase 2 of a `_P2PAllReduce`: a tagged position of its own, reserved at issue (the same position on every
    rank, wherever each posts its sends); receives posted at once, sends by ``post_sends``. Listed in the
    status like any tagged collective (``tagged.snapshot``: both directions, for a diverged peer's complements)."""

    def __init__(self, pg, me: int, parts: list, code: int):
        self.pg, self.group_name, self.me, self.fp_code, self.parts = pg, pg.group_name, me, code, parts
        self.fp_tag = tagged.issue(code, self)
        self.fp_nbytes = [(_nbytes(parts[me]), _nbytes(parts[j])) if j != me else (0, 0) for j in range(len(parts))]
        self.works = [pg.recv([parts[j]], j, self.fp_tag) for j in range(len(parts)) if j != me]
        self.sent = self.done = False

    def post_sends(self) -> None:
        if not self.sent:
            self.sent = True
            self.works += [self.pg.send([self.parts[self.me]], j, self.fp_tag)
                           for j in range(len(self.parts)) if j != self.me]

    def wait(self, timeout=None) -> bool:
        self.post_sends()
        if self.done:
            return True
        tagged.before_wait()
        try:
            for w in self.works:
                if (w.wait(timeout) if timeout is not None else w.wait()) is False:
                    return False
        finally:
            self.done, self.works, self.parts = True, [], None
            tagged.finished(self)
        tagged.after_wait()
        return True


class _P2PExchange(_P2PWork):
    """Rank ``r`` copies its row ``r`` into ``out`` row ``r``, sends row ``j`` to rank ``j`` and receives
    every peer's row in place (the all-to-all under a quantized reduce-scatter)."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group, n: int, bound: Optional[_Bound] = None):
        me = dist.get_rank(group)
        out[me].copy_(inp[me])
        super().__init__(group, me, list(inp), list(out), bound)
        self.keep = inp


class _P2PRotate(_P2PWork):
    """One step of a ring: ``inp`` to group rank ``me + 1``, ``out`` filled from rank ``me - 1`` (context
    parallel's rotating K/V). At two ranks both are the one peer."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group, n: int):
        me = dist.get_rank(group)
        sends, recvs = [None] * n, [None] * n
        sends[(me + 1) % n], recvs[(me - 1) % n] = inp, out
        super().__init__(group, me, sends, recvs)
        self.keep = inp

    def _post(self, pg, tag: int, sends: list, recvs: list) -> None:
        self.works = [w for j in range(len(sends)) if j != self.me
                      for w in ([pg.recv([recvs[j]], j, tag)] if recvs[j] is not None else [])
                      + ([pg.send([sends[j]], j, tag)] if sends[j] is not None else [])]
