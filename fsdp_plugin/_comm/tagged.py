"""Identity-tagged collectives: the pairing check of a mesh whose unit collectives are all point to point (issue 26).

On gloo with CPU tensors every per-unit collective is sends and receives (``p2p._P2PWork``). Their tag
names what the collective is: this process's **position** (the count of unit collectives it issued, the same
on every rank while the ranks agree) and the collective's **code** (all-gather or reduction, of which root,
unit and handle). Gloo moves a message only to a receive of the same tag, so two ranks that diverged never
exchange a byte: no abort (a message longer than the receive buffer), no mixed data, and no message of its
own either: agreeing ranks pay nothing but the bookkeeping below (a list store per collective).

What a divergence leaves is ranks waiting for messages that never come. It is found lazily, where nothing
else is waiting: this rank's status thread (``status._Publisher``, already publishing every INTERVAL_S) adds
the recent codes and the pending operations to its status; once this rank has waited in a tagged collective
for ``PROBE_AFTER_S``, it reads every rank's status. Two ranks with different codes at the same position
diverged there (codes never change once issued, so a stale status is still a proof). The ends of the forward
and of the backward are positions too (``mark``, no message), so "one rank has more collectives" is the same
test. Then, through the store: every rank learns the verdict (a key of the epoch), sets it locally, acknowledges,
and once every rank has acknowledged, each posts the *complement* of every peer's unmatched operation
addressed to it (a receive into scratch bytes, a send of zeros). Every wait then returns, and every wait and
issue raises the verdict's CollectiveError (the acknowledgement comes first, so no rank reads the scratch as
data). ``fp.reset`` (every rank) waits for everything left, agrees on the next position and starts a new epoch.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CollectiveError
from . import late, status
from .divergence import Entering, abandoning, divergence_message, is_abandoning
from .divergence import describe as _words

PROBE_AFTER_S = 0.5      # a tagged wait longer than this makes the status thread compare every rank's codes
_PROBE_MAX_S = 8.0       # then at 2x, 4x... that length, up to this gap between probes
_HISTORY = 4096          # codes kept per rank (positions modulo this); far more than are in flight
_PUBLISHED = 64          # recent codes published in the status: a rank blocks within a few positions of a divergence
_TAG_BASE = 1 << 30      # above the other point-to-point tags of collectives.py
_POS_BITS = 10
_KEY = "fsdp_plugin/pairing/"
_ENTERING_SHIFT, _ROOT_SHIFT, _UNIT_SHIFT = 40, 32, 8


class _Ledger:
    def __init__(self):
        self.pos = 0                                 # next position
        self.codes: list = [None] * _HISTORY         # pos % _HISTORY -> (pos, code)
        self.pending: dict = {}                      # pos -> _P2PWork not yet finished
        self.waiting_since: Optional[float] = None   # the main thread is blocked in a tagged wait since
        self.probe_after = PROBE_AFTER_S             # wait length of the next probe (doubles within a wait)
        self.verdict: Optional[str] = None           # the divergence message, once known
        self.acked = False
        self.epoch = 0
        self.complemented: set = set()               # (peer, group, tag, peer sends) posted by this rank
        self.complements: list = []                  # their works, waited in fp.reset
        self.settled = False                         # this rank posted its complements
        self.io = None                               # (store, statuses reader) of the status thread
        self.digest = 0                              # rolling hash of every (position, code) of this epoch
        self.verified = 0                            # positions below this were checked by the ledger hash
        self.lock = threading.RLock()                # the status thread's actions against the main thread's


_L = _Ledger()
_roots: dict = {}            # root number -> weakref to its RootState (unit names, the divergence hint)
_groups: dict = {}           # group name -> (weakref to the group, its global ranks): complements, tags


def new_root(root) -> int:
    """A number for a sharded model's root, in construction order (the same on every rank)."""
    n = len(_roots)
    _roots[n] = weakref.ref(root)
    return n


def code(entering: int, root: int, unit: int, handle: int) -> int:
    return (entering << _ENTERING_SHIFT) | (root << _ROOT_SHIFT) | (unit << _UNIT_SHIFT) | handle


def describe(c: int) -> str:
    entering, root = c >> _ENTERING_SHIFT, (c >> _ROOT_SHIFT) & 0xFF
    ref = _roots.get(root)
    state = ref() if ref is not None else None
    units = state.units if state is not None else ()
    unit = (c >> _UNIT_SHIFT) & ((1 << (_ROOT_SHIFT - _UNIT_SHIFT)) - 1)
    return _words((int(Entering(entering)) << 32) | unit, units)


def _tag(pos: int, c: int) -> int:
    # position and the code's parts, packed: at one position two different codes never share a tag
    entering, root = c >> _ENTERING_SHIFT, (c >> _ROOT_SHIFT) & 0x7
    unit, handle = (c >> _UNIT_SHIFT) & 0x1FFF, c & 0x7
    return _TAG_BASE + (((((pos % (1 << _POS_BITS)) << 1 | entering & 1) << 3 | root) << 13 | unit) << 3 | handle)


def _check() -> None:
    if _L.verdict is not None and not is_abandoning():
        with _L.lock:
            _settle_before_raising()
        raise CollectiveError(_L.verdict)


def issue(c: int, work) -> int:
    """Record a tagged collective about to be posted; its tag. Raises the verdict after a divergence."""
    with _L.lock:        # atomic with the verdict: a rank's final status lists every operation it posted
        _check()
        pos = _L.pos
        _L.pos = pos + 1
        _L.codes[pos % _HISTORY] = (pos, c)
        _L.digest = _fold(_L.digest, pos, c)
        _L.pending[pos] = work
    work.fp_pos = pos
    if work.group_name not in _groups:
        ranks_of(work.pg)            # registered for the complements this rank may have to post
    return _tag(pos, c)


def ranks_of(pg) -> list:
    """The global ranks of ``pg`` (cached: asked at every tagged collective); registers it for complements."""
    name = pg.group_name
    known = _groups.get(name)
    if known is None or known[0]() is not pg:
        known = _groups[name] = (weakref.ref(pg), dist.get_process_group_ranks(pg))
    return known[1]


def mark(c: int) -> None:
    """A position without a message: the end of a forward or of a backward (every rank must be there too)."""
    _check()
    pos = _L.pos
    _L.pos = pos + 1
    _L.codes[pos % _HISTORY] = (pos, c)
    _L.digest = _fold(_L.digest, pos, c)


_MASK64 = (1 << 64) - 1
_MUL = 0x9E3779B97F4A7C15    # odd 64-bit multiplier (Fibonacci hashing): every bit of a code reaches the digest


def _fold(digest: int, pos: int, c: int) -> int:
    """The rolling hash of the ledger: equal on two ranks iff (with 2^-64 odds) they issued the same codes at the
    same positions since the epoch began. One multiply-add per collective."""
    return ((digest ^ c ^ (pos << 48)) * _MUL + 1) & _MASK64


def digest() -> int:
    """This rank's ledger hash so far (``_comm/ledger.py`` folds it into the step's control all-reduce)."""
    return _L.digest


def codes_since_verified() -> list:
    """``[[position, code], ...]`` issued since the last hash that every rank agreed on (those still kept)."""
    return [list(e) for e in (_L.codes[p % _HISTORY] for p in range(max(_L.verified, _L.pos - _HISTORY), _L.pos))
            if e is not None]


def verified() -> None:
    """Every rank's ledger hash agreed: the codes so far are checked."""
    _L.verified = _L.pos


def first_divergence(codes: dict) -> Optional[str]:
    """rank -> {position: code}: the divergence message at the first position where two ranks differ (a rank
    without that position is "not there yet"), else None."""
    return _verdict_of(codes)


def set_verdict(message: str) -> None:
    """The ledger hash found a divergence: every later issue raises it until fp.reset (no complements: the
    hash path has no point-to-point operation left waiting for one)."""
    with _L.lock:
        _L.verdict, _L.acked, _L.settled = message, True, True


def finished(work) -> None:
    _L.pending.pop(work.fp_pos, None)
    _L.waiting_since = None


def before_wait() -> None:
    """A tagged wait starts: the status thread probes once it has lasted ``PROBE_AFTER_S``."""
    _check()
    _L.probe_after = PROBE_AFTER_S
    _L.waiting_since = time.time()


def after_wait() -> None:
    _L.waiting_since = None
    _check()


def diverged() -> bool:
    return _L.verdict is not None


# ------------------------------------------------------------------ the status thread's part
def snapshot() -> Optional[dict]:
    """This rank's part of its status (None before its first tagged collective)."""
    if _L.pos == 0:
        return None
    recent = [e for e in (_L.codes[p % _HISTORY] for p in range(max(_L.pos - _PUBLISHED, 0), _L.pos)) if e]
    ops = []
    for pos, work in list(_L.pending.items()):
        # [position, code, group, global peer, tag, bytes, True when *this rank* sends]: each peer both ways
        peers = [(j, r) for j, r in enumerate(ranks_of(work.pg)) if j != work.me]
        ops.extend([pos, work.fp_code, work.group_name, peer, work.fp_tag, work.fp_nbytes[j][0 if sends else 1],
                    sends] for j, peer in peers for sends in (False, True))
    return {"epoch": _L.epoch, "codes": recent, "ops": ops, "acked": _L.acked}


def on_tick(store, statuses_of, publish, notice_changed: bool = True) -> None:
    """One status-thread tick: probe a long tagged wait, learn a verdict, post complements. ``statuses_of()``:
    every rank's published status (rank -> dict or None); ``publish()``: publish this rank's status now;
    ``notice_changed``: the notice counter moved since the last read (a verdict may be there)."""
    _L.io = (store, statuses_of)
    with _L.lock:
        key = f"{_KEY}{_L.epoch}/"
        if _L.verdict is None:
            since, found = _L.waiting_since, False
            if since is not None and time.time() - since >= _L.probe_after:
                # backing off within one wait: a rank waiting minutes for a slow peer (a checkpoint) reads every
                # status a few times, not twice a second
                _L.probe_after = min(2 * _L.probe_after, _PROBE_MAX_S)
                verdict = _verdict(statuses_of(), _L.epoch)
                status.STORE_OPS[0] += 2             # check + multi_get of every rank's status
                if verdict is not None:
                    store.set(key + "diverged", verdict)
                    status.notify(store)
                    found = True
            # the verdict key is read only when the notice counter moved (issue 30: the store budget)
            if not (found or notice_changed) or not store.check([key + "diverged"]):
                return
            # From here this rank posts nothing new (``issue`` raises): its status now is its final one.
            _L.verdict = store.get(key + "diverged").decode()
            _L.acked = True
            publish()
        if not _L.settled:
            _settle(statuses_of)


def _settle(statuses_of) -> bool:
    """Complement every peer's operation addressed to this rank, once every rank published its final status."""
    final = {r: p for r, p in _pairing(statuses_of(), _L.epoch).items() if p.get("acked")}
    if len(final) < dist.get_world_size():
        return False
    _complement(final, dist.get_rank())
    _L.settled = True
    return True


def _settle_before_raising(limit_s: float = 60.0) -> None:
    """The main thread leaves with the verdict only once its complements are posted: a peer still waiting
    for one must not see this process end first (a closed connection instead of the verdict)."""
    deadline = time.time() + limit_s
    while not _L.settled and _L.io is not None and time.time() < deadline:
        if _settle(_L.io[1]):
            return
        time.sleep(0.05)


def _pairing(statuses: dict, epoch: int) -> dict:
    return {r: s["pairing"] for r, s in statuses.items()
            if s is not None and s.get("pairing") and s["pairing"]["epoch"] == epoch}


def _verdict(statuses: dict, epoch: int) -> Optional[str]:
    """The divergence message if two ranks' published codes differ at a position, else None."""
    codes = {r: {p: c for p, c in s["codes"]} for r, s in _pairing(statuses, epoch).items()}
    codes[dist.get_rank()] = {p: c for p, c in (e for e in _L.codes if e is not None)}
    return _verdict_of(codes)


def _verdict_of(codes: dict) -> Optional[str]:
    first = None
    ranks = sorted(codes)
    for i, r in enumerate(ranks):
        for s in ranks[i + 1:]:
            for p in sorted(set(codes[r]) & set(codes[s])):
                if codes[r][p] != codes[s][p]:
                    first = p if first is None else min(first, p)
                    break
    if first is None:
        return None
    names = "; ".join(f"rank {r}: " + (describe(codes[r][first]) if first in codes[r] else "not there yet")
                      for r in ranks)
    return divergence_message(names, _hint(codes, first))


def _hint(codes: dict, pos: int) -> str:
    for c in (cs[pos] for cs in codes.values() if pos in cs):
        ref = _roots.get((c >> _ROOT_SHIFT) & 0xFF)
        state = ref() if ref is not None else None
        if state is not None:
            return state.divergence_hint()
    return ""


def _mine_at(pos: int) -> Optional[int]:
    e = _L.codes[pos % _HISTORY]
    return e[1] if e is not None and e[0] == pos else None


def _complement(final: dict, me: int) -> None:
    """Post the other side of every peer's operation addressed to this rank that this rank never issued."""
    for peer, s in final.items():
        if peer == me:
            continue
        for pos, c, group, to, tag, nbytes, sends in s["ops"]:
            key = (peer, group, tag, sends)
            if to != me or _mine_at(pos) == c or key in _L.complemented:
                continue
            known = _groups.get(group)
            pg = known[0]() if known is not None else None
            if pg is None:
                continue
            _L.complemented.add(key)
            src = dist.get_group_rank(pg, peer)
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            _L.complements.append(pg.recv([buf], src, tag) if sends else pg.send([buf], src, tag))


def drain(control_group, timeout_s: float) -> None:
    """fp.reset after a divergence (every rank): wait for every tagged collective left (their complements come
    from the peers' status threads), agree on the next position, start a new epoch."""
    from datetime import timedelta
    with abandoning():
        for pos in sorted(_L.pending):
            work = _L.pending.get(pos)
            if work is not None:
                work.wait()
        deadline = timedelta(seconds=timeout_s)
        with _L.lock:
            complements, _L.complements = _L.complements, []
        for w in complements:
            w.wait(deadline)
    nxt = torch.tensor([_L.pos], dtype=torch.int64)
    dist.all_reduce(nxt, op=dist.ReduceOp.MAX, group=control_group)
    with _L.lock:
        _L.pos = int(nxt.item()) + _PUBLISHED
        _L.verified, _L.digest = _L.pos, 0
        _L.codes = [None] * _HISTORY
        _L.pending.clear()
        _L.verdict, _L.acked, _L.settled, _L.complemented = None, False, False, set()
        _L.epoch += 1


def _status_extra() -> dict:
    snap = snapshot()
    return {"pairing": snap} if snap is not None else {}


def _tick(publisher) -> None:
    on_tick(publisher.store, lambda: late._read(publisher.store, list(range(dist.get_world_size()))),
            publisher.publish, publisher.notice_changed)


status.EXTRAS.append(_status_extra)
status.TICKS.append(_tick)


def _reset_after_fork() -> None:
    global _L
    _L = _Ledger()
    _roots.clear()
    _groups.clear()


os.register_at_fork(after_in_child=_reset_after_fork)
