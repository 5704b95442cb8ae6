"""Who is late: every rank's last collectives, kept locally and published through the rendezvous store.

Hot path (every collective issued through :mod:`fsdp_plugin._comm.collectives`): a sequence number per
process group, one `_Op` appended to a ring of the last :data:`RING` operations, two timestamps. Nothing
is sent. A daemon thread (started at the first collective of a process group with more than one rank)
publishes this rank's status to the store every :func:`period` seconds (:data:`INTERVAL_S`, longer
beyond 128 ranks: the store budget below): the issued
count per group, the collective being waited for, the last one finished, and, while the rank is outside
any collective, the innermost Python line of the thread that trains. The store is the process group's
own (a TCPStore under torchrun, hosted by the agent), so reading it needs no collective.

At a deadline the raising rank publishes its own status at once, reads every member's of the stuck
group and names the ranks whose issued count in that group is below the stuck operation's number
("not arrived"), with what each was last doing and how long ago; it writes its ring to
``$FSDP_PLUGIN_TRACE_DIR/rank<r>.log`` (default: ``<tmp>/fsdp_plugin_trace``) and sets a key that makes
every other rank's thread write its own file (with its current Python stack) within ``INTERVAL_S``.

Invariant: every rank of a group issues that group's collectives in the same order (the contract of
any collective), so equal numbers name the same collective on every rank. Point-to-point sends and
receives involve two ranks only: they are kept in the ring but not numbered.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .. import _compat

from . import native

RING = 256              # operations kept per rank (a step issues a few dozen)
INTERVAL_S = 0.5        # publication period of the status thread; bounds how stale a live rank's status is
READ_TIMEOUT_S = 2.0    # store reads at a deadline: a dead store host must not add minutes to the error
ENABLED = True          # benchmarks/status_overhead.py measures the hot path by switching it off
# Store budget (issue 30): all ranks together do at most STORE_OPS_PER_S store operations per second while
# training. Each rank does OPS_PER_PERIOD per publication period (its status set; one read of the notice
# counter, which every dump request or divergence verdict bumps), so the period grows with the world:
# period = max(INTERVAL_S, N * OPS_PER_PERIOD / STORE_OPS_PER_S): 0.5 s up to 128 ranks, 4 s at 1,024.
# A rank whose main thread blocks in a collective publishes once at INTERVAL_S into the wait and reads the
# notice at 0.5, 1, 2, 4... s into it (up to the period): a stuck rank's status is fresh within a second.
STORE_OPS_PER_S = 512
OPS_PER_PERIOD = 2
STORE_OPS: list = [0]   # store operations issued by this process's status thread (the benchmark reads it)
_PREFIX = "fsdp_plugin/status/"
_DUMP_KEY = _PREFIX + "dump"
_NOTICE_KEY = _PREFIX + "notice"    # a counter: bumped with every dump request and divergence verdict
_DETAILED = 4           # late ranks described in full; the others are listed by number
EXTRAS: list = []       # () -> dict merged into this rank's status (``tagged``: the pairing ledger)
TICKS: list = []        # (publisher) -> None, every publication period (``tagged``: finding divergences)


class _Op:
    """One collective of this rank: ``seq`` (per group; None for point to point), wall-clock times (s)."""

    __slots__ = ("seq", "group", "kind", "what", "step", "numel", "t_issue", "t_wait", "t_done", "backend")

    def __init__(self, seq, group: str, kind: str, step: int, numel: int, backend: Optional[str] = None):
        self.seq, self.group, self.kind, self.step, self.numel = seq, group, kind, step, numel
        self.backend = backend        # the group's backend: whether its wait blocks the host (``collectives.wait``)
        self.what: Optional[str] = None
        self.t_issue, self.t_wait, self.t_done = time.time(), None, None

    def place(self) -> str:
        return f"collective #{self.seq} of group {self.group}, step {self.step}"

    def label(self) -> str:
        num = f"#{self.seq} " if self.seq is not None else ""
        return f"{num}{self.what or self.kind.replace('_', '-')} (group {self.group}, step {self.step})"


class _Tracked:
    """A torch Work with its `_Op` (pybind Work objects take no attributes); waited like the Work."""

    __slots__ = ("work", "fp_op")

    def __init__(self, work, op: _Op):
        self.work, self.fp_op = work, op

    def wait(self, timeout=None):
        return self.work.wait(timeout) if timeout is not None else self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _State:
    def __init__(self):
        self.ring: deque = deque(maxlen=RING)
        self.seq: dict = {}          # group name -> collectives issued
        self.done: dict = {}         # group name -> highest collective number completed
        self.members: dict = {}      # group name -> global ranks
        self.backends: dict = {}     # group name -> its backend ("gloo", "nccl", "fake", ...)
        self.step = 0
        self.current: Optional[_Op] = None    # being waited for
        self.last: Optional[_Op] = None       # last finished
        self.publisher: Optional[_Publisher] = None
        self.unpublishable = False
        # Before the process group that any peer's status belongs to: a status or dump request older than this
        # comes from a previous attempt (torchrun's agent store outlives restarts).
        self.born = time.time()


_S = _State()
os.register_at_fork(after_in_child=lambda: globals().__setitem__("_S", _State()))


# ------------------------------------------------------------------ hot path
def begin_step() -> None:
    """A sharded root's forward starts: the step of later operations (micro-batches count one each)."""
    _S.step += 1


def issued(work, kind: str, group, n: int, numel: int = 0):
    """Number and remember a collective just issued on ``group`` (``n`` ranks); returns what to wait on.
    ``work`` None: a synchronous call that already finished. ``group`` "p2p": a send or a receive."""
    if n <= 1 or not ENABLED:
        return work
    if group == "p2p":
        name, seq, backend = "p2p", None, dist.get_backend()
    else:
        pg = group if group is not None else _compat.default_group()
        name = pg.group_name
        seq = _S.seq.get(name, 0) + 1
        _S.seq[name] = seq
        if name not in _S.members:
            _S.members[name] = dist.get_process_group_ranks(pg)
            _S.backends[name] = dist.get_backend(pg)
        backend = _S.backends[name]
    op = _Op(seq, name, kind, _S.step, numel, backend)
    _S.ring.append(op)
    if _S.publisher is None and not _S.unpublishable:
        publishing()
    if work is None:
        op.t_wait = op.t_done = op.t_issue
        _S.last = op
        return None
    if hasattr(work, "fp_op"):       # our point-to-point collectives (_P2PWork)
        work.fp_op = op
        return work
    return _Tracked(work, op)


def publishing() -> bool:
    """Start the status thread now if it is not running; whether one runs (the tagged pairing check needs it)."""
    if ENABLED and _S.publisher is None and not _S.unpublishable and dist.is_initialized() and not native.is_fake():
        # (torch's fake group has no rendezvous store and no peers to report on: no status thread there)
        _S.publisher = _Publisher.start()
        _S.unpublishable = _S.publisher is None      # no store or no clone: not retried at every collective
    return _S.publisher is not None


def waiting(work, what: str):
    """``(op, work to wait on)``; marks ``op`` as the one this rank is waiting in."""
    op = getattr(work, "fp_op", None)
    if isinstance(work, _Tracked):
        work = work.work
    if op is not None:
        op.what, op.t_wait = what, time.time()
        _S.current = op
    return op, work


def finished(op: Optional[_Op]) -> None:
    """``op`` completed and the training thread has passed its wait (a blocking transport: both at once)."""
    if op is not None:
        passed(op)
        retired(op)


def passed(op: Optional[_Op]) -> None:
    """The training thread passed ``op``'s wait (on a stream transport the collective may still be running)."""
    if op is not None and _S.current is op:
        _S.current = None


def retired(op: Optional[_Op]) -> None:
    """``op`` completed (from the deadline monitor's thread on a stream transport): the late-rank report counts
    it as done in its group (``done``: the highest such number per group)."""
    if op is None:
        return
    op.t_done = time.time()
    if op.seq is not None and op.seq > _S.done.get(op.group, 0):
        _S.done[op.group] = op.seq
    if _S.last is None or _S.last.t_done is None or op.t_done >= _S.last.t_done:
        _S.last = op


# ------------------------------------------------------------------ publication
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Library code: the stdlib, site-packages (torch, Lightning...), this package and its integrations.
_SITE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__))))   # torch's site-packages
_LIBS = tuple(os.path.join(d, "") for d in (os.path.dirname(os.__file__), _SITE, _PKG,
                                           os.path.join(os.path.dirname(_PKG), "integrations")))


def _at(frame) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _where(tid: Optional[int]) -> Optional[str]:
    """The innermost Python line of thread ``tid`` (the one that trains), ``file:line in function``, and the
    innermost line of the user's own code when that is another one (``queues.py:113 in get (train.py:57 in
    main)``): a data loader's wait is only useful with the script line that called it."""
    frame = sys._current_frames().get(tid) if tid is not None else None
    if frame is None:
        return None
    inner, user = _at(frame), frame
    while user is not None and user.f_code.co_filename.startswith(_LIBS):
        user = user.f_back
    return inner if user is None or user is frame else f"{inner} (from {_at(user)})"


def _snapshot(tid: Optional[int]) -> dict:
    cur, last = _S.current, _S.last
    return {"rank": dist.get_rank(), "host": socket.gethostname(), "pid": os.getpid(), "t": time.time(),
            "step": _S.step, "seq": dict(_S.seq), "done": dict(_S.done),
            "cur": [cur.seq, cur.group, cur.label(), cur.t_wait] if cur is not None else None,
            "last": [last.seq, last.group, last.label(), last.t_done] if last is not None else None,
            "where": _where(tid) if cur is None else None, **{k: v for f in EXTRAS for k, v in f().items()}}


def _key(rank: int) -> str:
    return f"{_PREFIX}{rank}"


def period(world: Optional[int] = None) -> float:
    """Seconds between two publications of a rank's status at ``world`` ranks (default: this world)."""
    n = world if world is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    return max(INTERVAL_S, n * OPS_PER_PERIOD / STORE_OPS_PER_S)


def notify(store) -> None:
    """Tell every status thread to look at the dump and verdict keys at its next notice read."""
    store.add(_NOTICE_KEY, 1)


def blocked_since() -> Optional[float]:
    """When the training thread started waiting in the collective it is still in (None: not waiting)."""
    cur = _S.current
    return cur.t_wait if cur is not None else None


class _Publisher(threading.Thread):
    """Publishes this rank's status every INTERVAL_S while the process group it started in lives; writes
    the trace file when another rank asks (the dump key). Never raises: on any store error it stops."""

    def __init__(self, store, pg, tid: int):
        super().__init__(name="fsdp_plugin-status", daemon=True)
        self.store, self.pg, self.tid = store, weakref.ref(pg), tid
        self.stop_event, self.dumped = threading.Event(), None
        self.period = period()
        self.published = 0.0         # when this rank's status was last written
        self.notice, self.noticed = 0, 0.0   # last notice count read, and when
        self.notice_changed = False  # this tick saw a new notice: ticks look at their keys (``tagged``)

    @classmethod
    def start(cls) -> Optional["_Publisher"]:
        try:
            store = _compat.default_store().clone()
            store.set_timeout(timedelta(seconds=READ_TIMEOUT_S))    # its keys always exist: never waits
            pub = cls(store, _compat.default_group(), threading.get_ident())
            pub.publish()                          # the key exists from the first collective on
        except Exception:  # noqa: BLE001 - no store (or no clone): deadlines keep the plain message
            return None
        threading.Thread.start(pub)
        return pub

    def publish(self) -> None:
        self.store.set(_key(dist.get_rank()), json.dumps(_snapshot(self.tid)))
        self.published = time.time()
        STORE_OPS[0] += 1

    def _read_notice(self) -> None:
        count = self.store.add(_NOTICE_KEY, 0)
        STORE_OPS[0] += 1
        self.noticed, self.notice_changed = time.time(), count != self.notice
        self.notice = count

    def _tick(self) -> None:
        """One wake-up (every INTERVAL_S, local): the store operations that are due under the budget."""
        now, since = time.time(), blocked_since()
        self.notice_changed = False
        blocked = since is not None and now - since >= INTERVAL_S
        if now - self.published >= self.period or blocked and self.published < since + INTERVAL_S:
            self.publish()
        # while blocked, the notice is read at 0.5, 1, 2, 4 ... s into the wait (a verdict or dump reaches a
        # stuck rank quickly); otherwise once per period
        gap = min(self.period, max(INTERVAL_S, now - since)) if blocked else self.period
        if now - self.noticed >= gap - 1e-3:
            self._read_notice()
            if self.notice_changed:
                self._maybe_dump()

    def alive_group(self) -> bool:
        return dist.is_initialized() and self.pg() is _compat.default_group()

    def run(self) -> None:
        try:
            while not self.stop_event.wait(INTERVAL_S) and self.alive_group():
                self._tick()
                for tick in TICKS:
                    tick(self)
        except Exception:  # noqa: BLE001 - a closed store or group ends the thread, never the training
            pass
        if _S.publisher is self:
            _S.publisher = None

    def _maybe_dump(self) -> None:
        if not self.store.check([_DUMP_KEY]):
            return
        request = self.store.get(_DUMP_KEY).decode()
        t, _, reason = request.partition("|")
        if request != self.dumped and float(t or 0) >= _S.born:
            self.dumped = request
            write_trace(f"asked by {reason}", self.tid)


def report_store():
    """A store connection for the deadline report with :data:`READ_TIMEOUT_S`: the status thread's own (already
    connected: a dead store host fails it in milliseconds; TCPStore serializes the two threads' operations),
    else a new clone, connected with that timeout rather than the store's own (minutes)."""
    pub = _S.publisher
    if pub is not None:
        return pub.store
    base = _compat.default_store()
    old = base.timeout
    base.set_timeout(timedelta(seconds=READ_TIMEOUT_S))
    try:
        return base.clone()
    finally:
        base.set_timeout(old)


def stop() -> None:
    """End the status thread (fp.shutdown, before the groups go away)."""
    pub = _S.publisher
    if pub is not None:
        pub.stop_event.set()
        pub.join(timeout=2 * INTERVAL_S)
        _S.publisher = None


# ------------------------------------------------------------------ trace file
def trace_dir() -> str:
    return os.environ.get("FSDP_PLUGIN_TRACE_DIR") or os.path.join(tempfile.gettempdir(), "fsdp_plugin_trace")


def _clock(t: Optional[float]) -> str:
    if t is None:
        return "-" * 12
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def trace_line(op: _Op) -> str:
    """One collective: number, group, kind, step, elements, issue/wait/done clock times, state, what."""
    state = "done" if op.t_done else ("WAITING" if op.t_wait else "issued")
    seq = f"#{op.seq}" if op.seq is not None else "p2p"
    return (f"{seq:>8}  group {op.group:<6} {op.kind:<15} step {op.step:<6} numel {op.numel:<10} "
            f"issued {_clock(op.t_issue)}  waited {_clock(op.t_wait)}  done {_clock(op.t_done)}  "
            f"{state:<7}  {op.what or ''}").rstrip()


def write_trace(reason: str, tid: Optional[int] = None) -> Optional[str]:
    """Write this rank's ring (oldest first) and the training thread's Python stack; the path, or None."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(trace_dir(), f"rank{rank:05d}.log")
    lines = [f"# fsdp_plugin collectives of rank {rank} (host {socket.gethostname()}, pid {os.getpid()}), "
             f"written {_clock(time.time())}: {reason}", f"# last {len(_S.ring)} of at most {RING}, oldest first"]
    lines += [trace_line(op) for op in list(_S.ring)]
    frame = sys._current_frames().get(tid if tid is not None else threading.get_ident())
    if frame is not None:
        lines += ["# Python stack of the training thread, innermost last:"]
        lines += [ln.rstrip() for ln in traceback.format_stack(frame)]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    except OSError:
        return None
    return path
