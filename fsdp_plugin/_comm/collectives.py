"""The only module that talks to torch.distributed collectives; it counts calls and bytes by kind.

Bytes are per rank on a ring: all-gather and reduce-scatter move ``total * (N-1)/N`` elements,
all-reduce ``2 * total * (N-1)/N``, broadcast/scatter/gather ``total * (N-1)/N`` (amortized), a
point-to-point send or receive its tensor's bytes. A group of one rank moves nothing and no call is issued.

Blocking operations (:func:`barrier`, :func:`broadcast`, :func:`gather`, :func:`all_gather_list`,
:func:`send`, :func:`recv`, :func:`all_reduce` with ``what=``) are issued asynchronously and waited
with a deadline, so a peer that died or stalls becomes a :class:`CollectiveError` naming ``what``
within ``timeout_s`` (default: ``FSDP_PLUGIN_TIMEOUT_S`` or 480 s) instead of torch's default timeout.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .. import _compat
from ..errors import CollectiveError
from . import deadlines, failure, late, native, nodes, status, tagged, transport
from . import p2p
from .p2p import (_P2PAllGather, _P2PAllReduce, _P2PExchange, _P2PPairSum, _P2PReduceScatter, _P2PRotate, Recorded,
                  Tagged, _Bound)
from .stats import _SYNC_KINDS, STATS, SYNC, CommStats, SyncStats, _split, ring_bytes  # noqa: F401
from .stats import _count as _count_bytes
from .transport import Transport

FAILED = False   # a collective of this process failed or timed out (fp.shutdown then leaves the groups alone)
# deadlines of collectives waited without blocking the host (every backend but gloo): ``deadlines.py``
# (its failures poison the process's training state: ``failure.py``)
MONITOR = deadlines.Monitor(lambda *a: failure.poison(_collective_error(*a)), deadlines.abort_group)
os.register_at_fork(after_in_child=lambda: globals().__setitem__(
    "MONITOR", deadlines.Monitor(lambda *a: failure.poison(_collective_error(*a)), deadlines.abort_group)))


def _count(*args, **kwargs) -> None:
    """Every collective's first line: a deadline the monitor found raises here, before anything is issued."""
    MONITOR.check()
    _count_bytes(*args, **kwargs)


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, kind: str = "all_gather",
               gate=None, what: str = "all-gather"):
    """Gather ``inp`` (one chunk per rank) into ``out`` (``n * inp.numel()`` elements), rank order.

    On gloo with CPU tensors the chunks go point to point (`_P2PAllGather`): torch's gloo all-gather gathers
    into a temporary flat buffer and copies it out, one extra full-size buffer and copy per call.
    ``gate``: the collective's pairing announcement (`pairing.Gate`, see there; ``what`` names it)."""
    n = group_size(group)
    _count(kind, out.numel(), out.element_size(), n, group=group)
    if _p2p_ok(group, out, inp):
        work = _P2PAllGather(out, inp, group, n, _Bound.of(gate, what))
        return _issued(status.issued(work, kind, group, n, out.numel()), async_op)
    _ungated(gate, what)
    return status.issued(_compat.all_gather_into(out, inp, group=group, async_op=async_op), kind, group, n,
                         out.numel())


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False, gate=None,
                   what: str = "reduce-scatter"):
    """Sum ``inp`` across ranks and keep this rank's chunk in ``out`` (``inp.numel() / n`` elements).

    On gloo with CPU tensors the chunks go point to point (`_P2PReduceScatter`): torch's gloo reduce-scatter
    copies the whole input and all-reduces it, moving twice the ring bytes. ``gate``: as for `all_gather`."""
    n = group_size(group)
    _count("reduce_scatter", inp.numel(), inp.element_size(), n, group=group)
    if _p2p_ok(group, out, inp):
        work = _P2PReduceScatter(out, inp, group, n, _Bound.of(gate, what))
        return _issued(status.issued(work, "reduce_scatter", group, n, inp.numel()), async_op)
    _ungated(gate, what)
    return status.issued(_compat.reduce_scatter_into(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op),
                         "reduce_scatter", group, n, inp.numel())


def exchange(out: torch.Tensor, inp: torch.Tensor, group, kind: str, gate=None, what: str = "exchange"):
    """All-to-all of equal rows, asynchronously: row ``j`` of ``inp`` (``(n, m)``) goes to group rank ``j``,
    whose row ``r`` of ``out`` receives it from rank ``r`` (this rank's own row is copied). Counted with the
    ring formula over ``inp`` (``(n−1)·m`` elements sent per rank, as a reduce-scatter of ``inp``). On gloo with
    CPU tensors point to point (`_P2PExchange`), else torch's all-to-all. ``gate``: as for `all_gather`."""
    n = group_size(group)
    _count(kind, inp.numel(), inp.element_size(), n, group=group)
    if _p2p_ok(group, out, inp):
        work = _P2PExchange(out, inp, group, n, _Bound.of(gate, what))
        return status.issued(work, kind, group, n, inp.numel())
    _ungated(gate, what)
    return status.issued(dist.all_to_all_single(out, inp, group=group, async_op=True), kind, group, n, inp.numel())


def rotate(out: torch.Tensor, inp: torch.Tensor, group, kind: str, what: str = "ring rotation"):
    """One step of a ring, asynchronously (wait the result with :func:`wait`): ``inp`` goes to group rank
    ``me + 1``, ``out`` receives rank ``me − 1``'s (same size). Counted as one point-to-point send of ``inp``
    (C−1 rotations of one block move what an all-gather of C blocks moves). On gloo with CPU tensors point to
    point (`_P2PRotate`), else torch's all-to-all with zero splits to every rank but the two neighbours."""
    MONITOR.check()
    n = group_size(group)
    sent = inp.numel() * inp.element_size() if n > 1 else 0
    STATS.calls[kind] += 1
    STATS.bytes[kind] += sent
    if n == 1:
        out.copy_(inp)
        return None
    me = rank_in(group)
    nxt, prev = (me + 1) % n, (me - 1) % n
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    _split(kind, sent, sent * nodes.is_off_node(ranks[nxt]))
    if _p2p_ok(group, out, inp):
        return status.issued(_P2PRotate(out, inp, group, n), kind, group, n, inp.numel())
    ins, outs = [0] * n, [0] * n
    ins[nxt], outs[prev] = inp.numel(), out.numel()
    work = dist.all_to_all_single(out.view(-1), inp.reshape(-1), outs, ins, group=group, async_op=True)
    return status.issued(work, kind, group, n, inp.numel())


def rank_in(group) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def announce(everyone: torch.Tensor, mine: torch.Tensor, group):
    """Pairing announcement (``_comm.pairing.Gate``): ``mine`` (one int64) of every rank of ``group`` (gloo,
    CPU) into ``everyone``, asynchronously; ``(work to wait on, its torch future)``. torch's own all-gather,
    not the point-to-point one: its future runs the callback that posts a gated collective."""
    n = group_size(group)
    _count("control", everyone.numel(), everyone.element_size(), n, group=group)
    work = _compat.all_gather_into(everyone, mine, group=group, async_op=True)
    return status.issued(work, "pairing", group, n, everyone.numel()), work.get_future()


def _ungated(gate, what: str) -> None:
    """A native collective cannot be posted conditionally: under ``pairing_check="strict"`` its gate's verdict
    is waited on the host before it is issued (on NCCL a gloo round trip, no device synchronization), so a
    mismatched one is never issued; a `Recorded` one is only written to the ledger (checked at the step's end)."""
    if isinstance(gate, Recorded):
        tagged.mark(gate.code)
    elif gate is not None and not isinstance(gate, Tagged):
        gate.wait(what)


def _p2p_ok(group, out: torch.Tensor, inp: torch.Tensor) -> bool:
    return (out.device.type == "cpu" and inp.device.type == "cpu" and out.is_contiguous() and inp.is_contiguous()
            and native.point_to_point(group))


def inflight_host_bytes(kind: str, full_bytes: int, n: int, gloo_cpu: bool) -> int:
    """Bytes a sharded collective allocates beside its input and output while in flight (the planner's rule).

    The point-to-point gloo path receives every peer's chunk of a reduce-scatter before summing: ``(n - 1)``
    chunks, ``full_bytes·(n−1)/n``; its all-gather receives in place (0). Its tagged all-reduce (``gloo_cpu``
    here: pairing check "auto") receives the peer's whole tensor at two ranks (``_P2PPairSum``) and the peers'
    parts above (``_P2PAllReduce``, ``full_bytes·(n−1)/n``). NCCL writes in place (0)."""
    if not gloo_cpu or n <= 1 or kind not in ("reduce_scatter", "all_reduce"):
        return 0
    if kind == "all_reduce" and n == 2:
        return full_bytes
    return full_bytes * (n - 1) // n


def _issued(work, async_op: bool):
    if async_op:
        return work
    op, work = status.waiting(work, "")
    work.wait()
    status.finished(op)
    return None


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False, kind: str = "all_reduce",
               what: Optional[str] = None, timeout_s: Optional[float] = None, gate=None):
    """In-place all-reduce; ``kind="control"`` keeps small bookkeeping out of the training-bytes formula.
    With ``what`` and not ``async_op``, a blocking call waited with a deadline (see module docstring). ``gate``: its pairing
    announcement, waited before the (native, so ungated) all-reduce is issued."""
    n = group_size(group)
    _count(kind, t.numel(), t.element_size(), n, factor=2, group=group)
    if type(gate) is Tagged and _p2p_ok(group, t, t):    # a unit's reduction on gloo/CPU: tagged like the rest
        bound = _Bound(gate, what or "all-reduce")
        work = _P2PPairSum(t, group, bound) if n == 2 else _P2PAllReduce(t, group, n, bound)
        return _issued(status.issued(work, kind, group, n, t.numel()), async_op)
    _ungated(gate, what or "all-reduce")
    if what is None or async_op:     # ``what`` names a blocking call; an asynchronous one is named at its wait
        return status.issued(dist.all_reduce(t, op=op, group=group, async_op=async_op), kind, group, n, t.numel())
    _blocking(status.issued(dist.all_reduce(t, op=op, group=group, async_op=True), kind, group, n, t.numel()),
              what, timeout_s)


def broadcast(t: torch.Tensor, src: int, group, what: str = "broadcast", timeout_s: Optional[float] = None,
              kind: str = "broadcast") -> None:
    """Rank ``src``'s ``t`` into ``t`` on every rank of ``group`` (global rank ``src``); blocking, with a deadline."""
    n = group_size(group)
    _count(kind, t.numel(), t.element_size(), n, group=group)
    _blocking(status.issued(dist.broadcast(t, src=src, group=group, async_op=True), kind, group, n, t.numel()),
              what, timeout_s)


def broadcast_bytes(data: Optional[bytes], src: int, what: str = "broadcast",
                    timeout_s: Optional[float] = None) -> bytes:
    """Rank ``src``'s ``data`` on every rank, as uint8 tensors (size first): the way to broadcast an object is
    to encode it (JSON, the checkpoint codec) and send these bytes, never pickle. Blocking, with a deadline."""
    if not dist.is_initialized() or group_size(None) == 1:
        return data or b""
    dev = device()
    n = torch.tensor([len(data or b"")], dtype=torch.int64, device=dev)
    broadcast(n, src, None, what=what, timeout_s=timeout_s, kind="control")
    buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
    if dist.get_rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if buf.numel():
        broadcast(buf, src, None, what=what, timeout_s=timeout_s, kind="control")
    return buf.cpu().numpy().tobytes()


def barrier(what: str, timeout_s: Optional[float] = None, group=None) -> None:
    """Every rank of ``group`` reached this point (and, on gloo, its earlier work completed); with a deadline."""
    if not dist.is_initialized() or group_size(group) == 1:
        return
    STATS.calls["barrier"] += 1
    kw = {"device_ids": [device().index]} if device().type == "cuda" else {}
    work = status.issued(dist.barrier(group=group, async_op=True, **kw), "barrier", group, group_size(group))
    _blocking(work, what, timeout_s)


def all_gather_list(outs: list, t: torch.Tensor, group=None, what: str = "all_gather",
                    timeout_s: Optional[float] = None, kind: str = "control") -> None:
    """Gather ``t`` from every rank into ``outs[r]`` (same shape on every rank); blocking, with a deadline."""
    n = group_size(group)
    _count(kind, t.numel() * n, t.element_size(), n, group=group)
    _blocking(status.issued(dist.all_gather(outs, t, group=group, async_op=True), kind, group, n, t.numel() * n),
              what, timeout_s)


def gather(t: torch.Tensor, outs: Optional[list], dst: int, group=None, what: str = "gather",
           timeout_s: Optional[float] = None, kind: str = "control") -> None:
    """Every rank's ``t`` into ``outs[r]`` on rank ``dst`` (``outs`` None elsewhere); blocking, with a deadline."""
    n = group_size(group)
    _count(kind, t.numel() * n, t.element_size(), n, group=group)
    _blocking(status.issued(dist.gather(t, outs, dst=dst, group=group, async_op=True), kind, group, n, t.numel() * n),
              what, timeout_s)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, group, what: str,
               timeout_s: Optional[float] = None, kind: str = "optim_exchange", host: bool = True) -> None:
    """Rank ``r`` sends ``inp``'s ``in_splits[j]`` elements (in order) to group rank ``j`` and receives
    ``out_splits[j]`` from it into ``out``; blocking, with a deadline. Counted as the bytes this rank sends to
    others (its own split stays local), like a point-to-point send. ``host=False``: on a stream backend (NCCL)
    only the current stream waits for it (``out`` is read on the device, not by the host)."""
    n = group_size(group)
    me = dist.get_rank(group) if n > 1 else 0
    STATS.calls[kind] += 1
    sent = (sum(in_splits) - in_splits[me]) * inp.element_size()
    STATS.bytes[kind] += sent
    if n > 1:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        _split(kind, sent, sum(k for r, k in zip(ranks, in_splits) if nodes.is_off_node(r)) * inp.element_size())
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    if host:
        _blocking(work, what, timeout_s)
    else:
        wait(work, what, default_timeout_s(timeout_s))


def send(t: torch.Tensor, dst: int, what: str = "send", timeout_s: Optional[float] = None) -> None:
    """Point-to-point: ``t`` to global rank ``dst``, which must :func:`recv` it; blocking, with a deadline."""
    STATS.calls["p2p"] += 1
    STATS.bytes["p2p"] += t.numel() * t.element_size()
    _split("p2p", t.numel() * t.element_size(), t.numel() * t.element_size() * nodes.is_off_node(dst))
    _blocking(status.issued(dist.isend(t, dst=dst), f"send to {dst}", "p2p", 2, t.numel()), what, timeout_s)


def recv(t: torch.Tensor, src: int, what: str = "recv", timeout_s: Optional[float] = None) -> None:
    """Point-to-point: fill ``t`` from global rank ``src``'s :func:`send`; blocking, with a deadline."""
    STATS.calls["p2p"] += 1
    STATS.bytes["p2p"] += t.numel() * t.element_size()
    _split("p2p", t.numel() * t.element_size(), t.numel() * t.element_size() * nodes.is_off_node(src))
    _blocking(status.issued(dist.irecv(t, src=src), f"recv from {src}", "p2p", 2, t.numel()), what, timeout_s)


def device() -> torch.device:
    """The one device of process-group tensors: the current CUDA device for NCCL (set it with
    ``torch.cuda.set_device(local_rank)`` before the first collective, as NCCL requires), else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _blocking(work, what: str, timeout_s: Optional[float]) -> None:
    wait(work, what, default_timeout_s(timeout_s), host=True)


def scatter(out: torch.Tensor, chunks: Optional[list], src: int, group) -> None:
    """Rank ``src`` sends ``chunks[r]`` to rank r (global rank ``src``)."""
    n = group_size(group)
    _count("scatter", out.numel() * n, out.element_size(), n, group=group)
    status.issued(dist.scatter(out, chunks, src=src, group=group), "scatter", group, n, out.numel())


def wait(work, what: str = "collective", timeout_s: Optional[float] = None, host: bool = False) -> None:
    """Wait for ``work``; a peer that died or diverged becomes a CollectiveError within ``timeout_s``.

    By the transport of the work's group (``transport.py``): ``BLOCKING`` (gloo, our point-to-point works): the
    wait blocks the host anyway, so it carries the deadline. ``STREAM`` (NCCL, ``nccl_sim``...): the monitor
    watches the collective from before the plain ``wait()`` (which only orders the current stream after it), so
    even a wait that does block has the deadline; the host never waits for the device here unless ``host`` (a
    value it reads at once), and then it polls, never ``wait(timeout=)``. The collective counts as finished for
    the late-rank report when it has completed, not when the host passed its wait."""
    if work is None:
        return
    MONITOR.check()
    mode = _transport_of(work)
    op, work = status.waiting(work, what)
    if op is not None and op.kind in _SYNC_KINDS:
        SYNC.waits[op.kind] += 1
    if mode is Transport.BLOCKING:
        _checked(work.wait, what, timeout_s, op)
        status.finished(op)
        return
    if mode is Transport.FAKE:       # torch's FakeWork never reports completion, though it has nothing left to do
        _checked(work.wait, what, None, op)
        status.finished(op)
        return
    handle = MONITOR.watch(work, op, what, default_timeout_s(timeout_s), op.group if op is not None else None,
                           on_retire=status.retired)
    if host:
        SYNC.host[_backend_of(op)] += 1
        MONITOR.wait_done(handle)
    _checked(work.wait, what, None, op)
    handle.after_wait(device())
    status.passed(op)


def _transport_of(work) -> Transport:
    """The transport of ``work``'s group; our point-to-point works are gloo's."""
    if isinstance(work, p2p._P2PWork):
        return Transport.BLOCKING
    return transport.of_backend(_backend_of(getattr(work, "fp_op", None)))


def _backend_of(op) -> str:
    if op is not None and op.backend is not None:
        return op.backend
    return dist.get_backend() if dist.is_initialized() else "gloo"


def advance(work, what: str = "collective", timeout_s: Optional[float] = None) -> bool:
    """Take ``work`` as far as it goes without waiting for a peer's later stage (a tagged all-reduce: its own
    sum done, phase 2 posted); True if a later ``wait`` remains, False if ``work`` has no such stage."""
    if not isinstance(work, _P2PAllReduce):
        return False
    _checked(work.advance, what, timeout_s, work.fp_op)
    return True


def _checked(wait_fn, what: str, timeout_s: Optional[float], op) -> None:
    """``wait_fn(timeout=...)``; a failure or a timeout becomes the CollectiveError naming ``what``."""
    try:
        if timeout_s:
            SYNC.timed[_backend_of(op)] += 1
        ok = wait_fn(timeout=timedelta(seconds=timeout_s)) if timeout_s else wait_fn()
    except CollectiveError:
        raise                    # a gated collective's pairing verdict: already the whole story
    except RuntimeError as e:
        if MONITOR.error is not None:    # the monitor failed it (a deadline) and aborted the group: its story
            raise MONITOR.error from e
        raise _collective_error(what, timeout_s, e, op) from e
    if ok is False:
        raise _collective_error(what, timeout_s, None, op)


def _collective_error(what: str, timeout_s, cause, op=None) -> CollectiveError:
    """The error of a failed or timed-out wait; with the operation's record (``op``), the late ranks are
    named from the rendezvous store (:func:`late.report`)."""
    global FAILED
    FAILED = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = str(cause).splitlines()[0][:300] if cause else ""
    where = f" ({op.place()})" if op is not None and op.seq is not None else ""
    known = late.report(op)
    if cause is None or "timed out" in text.lower() or "timeout" in text.lower():
        guess = known or "Another rank probably failed, is stuck or ran different units; check its log."
        return CollectiveError(
            f"rank {rank}: {what}{where} did not complete within {timeout_s or 0:.0f}s. {guess} The limit is "
            f"ShardingConfig(timeout_s=...) or the FSDP_PLUGIN_TIMEOUT_S environment variable (default "
            f"{DEFAULT_TIMEOUT_S:.0f} s).")
    guess = f"Another rank probably died or was killed. {known}" if known else \
        "Another rank probably died or was killed; check its log."
    return CollectiveError(f"rank {rank}: {what}{where} failed ({text}). {guess}")


# 480 s: NCCL's default process-group timeout (600 s) less the backstop margin (``_groups/timeouts.py``), so that on
# a default run the deadline fires first and names the late rank, and borrowed default groups need no warning
# (tests/test_group_timeouts.py checks the relation).
DEFAULT_TIMEOUT_S = 480.0


def default_timeout_s(configured: Optional[float]) -> float:
    return float(configured if configured is not None else os.environ.get("FSDP_PLUGIN_TIMEOUT_S", DEFAULT_TIMEOUT_S))


# ---------------------------------------------------------------- byte messages (JSON control payloads)
# Objects travel as encoded bytes in uint8 tensors (never pickle), padded to the longest rank's message;
# lengths first, one int64 per rank, so each message is cut back to its own size.

def _as_tensor(data: bytes, size: int, dev: torch.device) -> torch.Tensor:
    buf = torch.zeros(max(size, 1), dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def all_gather_lengths(n: int, group=None, what: str = "all_gather", timeout_s: Optional[float] = None,
                       dev: Optional[torch.device] = None) -> list[int]:
    """Every rank's ``n`` (indexed by rank in ``group``), one int64 each; blocking, with a deadline."""
    if not dist.is_initialized():
        return [n]
    mine = torch.tensor([n], dtype=torch.int64, device=dev or device())
    sizes = [torch.zeros_like(mine) for _ in range(group_size(group))]
    all_gather_list(sizes, mine, group, what=what, timeout_s=timeout_s)
    return torch.cat(sizes).tolist()  # one host sync for every rank's length


def all_gather_bytes(data: bytes, group=None, what: str = "all_gather", timeout_s: Optional[float] = None,
                     dev: Optional[torch.device] = None, lengths: Optional[list] = None) -> list[bytes]:
    """Every rank's ``data`` (indexed by rank in ``group``); ``lengths``: every rank's ``len(data)`` when the
    caller already gathered them (:func:`all_gather_lengths`), saving that collective. Blocking, deadline."""
    if not dist.is_initialized():
        return [data]
    dev = dev or device()
    if lengths is None:
        lengths = all_gather_lengths(len(data), group, what, timeout_s, dev)
    mine = _as_tensor(data, max(lengths), dev)
    outs = [torch.zeros_like(mine) for _ in lengths]
    all_gather_list(outs, mine, group, what=what, timeout_s=timeout_s)
    return [_to_bytes(o[:k]) for o, k in zip(outs, lengths)]


def gather_bytes(data: bytes, dst: int = 0, group=None, what: str = "gather", timeout_s: Optional[float] = None,
                 dev: Optional[torch.device] = None) -> Optional[list[bytes]]:
    """Every rank's ``data`` on global rank ``dst`` (indexed by rank); None on the others. Blocking, deadline."""
    if not dist.is_initialized():
        return [data]
    dev, world, me = dev or device(), group_size(group), dist.get_rank()
    # Every rank needs the longest length (the padded size of the gather): one all-gather of lengths instead of
    # a gather to ``dst`` and a broadcast of the maximum.
    lens = all_gather_lengths(len(data), group, what, timeout_s, dev)
    mine = _as_tensor(data, max(lens), dev)
    outs = [torch.zeros_like(mine) for _ in range(world)] if me == dst else None
    gather(mine, outs, dst, group, what=what, timeout_s=timeout_s)
    return [_to_bytes(o[:k]) for o, k in zip(outs, lens)] if outs is not None else None
