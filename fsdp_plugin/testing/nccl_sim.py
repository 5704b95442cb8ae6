"""``nccl_sim``: a CPU process-group backend with NCCL's completion semantics, for testing NCCL code paths on a
laptop or in CI (no GPU).

What it models, where a program can tell NCCL from gloo:

- **Asynchronous completion.** Every collective is queued to one worker thread per group (an NCCL
  communicator's stream) and runs there over an inner gloo group; ``is_completed()`` says truthfully whether it
  has finished, from any thread, at any time.
- **Waits that do not block the host.** NCCL's plain ``work.wait()`` only orders the current stream after the
  collective. A CPU has no stream to defer to, so the plain wait here returns once the data is in place, and is
  counted as a *stream wait* (what NCCL would do on the device), not as a host wait. What blocks the host on
  NCCL is counted as a host wait: ``wait(timeout=...)``, ``synchronize()``, ``result()``, and
  ``is_completed()`` polled on the thread that issued the collective.
- **A mismatched collective never completes.** NCCL pairs collectives by issue order; when ranks issue
  different collectives (a different size, kind or dtype) NCCL hangs or exchanges wrong data, and the host runs
  ahead. Here each collective first exchanges a small header on the inner group: on a mismatch that collective
  and every later one of the group never complete, their plain waits return at once (the host runs ahead) and
  their floating-point outputs hold NaN (the garbage a real run would compute on). A rank that issues a
  collective its peers never issue waits until the group is aborted, as on NCCL.
- **Abort.** ``group.abort()`` fails every pending collective of the group (``is_completed()`` True,
  ``exception()`` set, ``wait()`` raises) and every later one at issue, as ``ProcessGroupNCCL::abort`` does.

It is neither gloo nor torch's fake group, so code that branches on the backend takes its non-gloo branch.
Register it by importing :mod:`fsdp_plugin.testing`, then ``dist.init_process_group("nccl_sim", ...)`` (also
under ``torchrun``). Counters: :data:`COUNTERS` (this process), reset with ``COUNTERS.reset()``.
"""
from __future__ import annotations

import os
import queue
import threading
import zlib
from collections import Counter
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "nccl_sim"

_KINDS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 3, "broadcast": 4, "barrier": 5, "all_to_all": 6,
          "gather": 7, "scatter": 8, "all_gather_list": 9, "reduce": 10}


class Counters:
    """Host-blocking calls (``host``: by call), plain waits (``stream_waits``) and collectives issued
    (``issued``: by kind) of this process, over every ``nccl_sim`` group."""

    def __init__(self):
        self.host: Counter = Counter()
        self.stream_waits = 0
        self.issued: Counter = Counter()
        self.aborts = 0

    def reset(self) -> None:
        self.__init__()

    @property
    def host_blocking(self) -> int:
        return sum(self.host.values())


COUNTERS = Counters()
os.register_at_fork(after_in_child=COUNTERS.reset)


class SimWork(dist.Work):
    """One collective of an ``nccl_sim`` group: complete once the worker thread ran it (or failed it)."""

    def __init__(self, kind: str, outputs: list):
        super().__init__()
        self.kind, self._outputs = kind, outputs
        self._done = threading.Event()     # finished, failed, or stuck (the host may run ahead)
        self._completed = False
        self._error: Optional[BaseException] = None
        self._issuer = threading.get_ident()
        self._future = Future()

    # ------------------------------------------------ the worker's side
    def _finish(self) -> None:
        self._completed = True
        self._done.set()
        self._future.set_result(self._outputs)

    def _fail(self, error: BaseException) -> None:
        if self._completed:
            return
        self._error, self._completed = error, True
        self._done.set()
        self._future.set_exception(error)

    def _stick(self) -> None:
        """Never completes; the host runs ahead over garbage (NaN in floating outputs)."""
        for t in self._outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.fill_(float("nan"))
        self._done.set()

    # ------------------------------------------------ the caller's side
    def is_completed(self) -> bool:
        if threading.get_ident() == self._issuer:
            COUNTERS.host["is_completed"] += 1
        return self._completed

    def exception(self):
        return self._error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            COUNTERS.host["wait(timeout)"] += 1
            if not self._done.wait(timeout.total_seconds()):
                raise RuntimeError(f"nccl_sim: {self.kind} timed out after {timeout.total_seconds():.0f}s")
        else:
            COUNTERS.stream_waits += 1
            self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"nccl_sim: {self.kind} failed: {self._error}")
        return True

    def synchronize(self) -> None:
        COUNTERS.host["synchronize"] += 1
        self._done.wait()

    def result(self) -> list:
        COUNTERS.host["result"] += 1
        self.wait()
        return self._outputs

    def get_future(self) -> Future:
        return self._future


class SimGroup(dist.ProcessGroup):
    """One ``nccl_sim`` process group: an inner gloo group and the worker thread that runs its collectives."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, ""
        self._inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck = False
        self._aborted: Optional[BaseException] = None
        self._pending: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="nccl_sim-worker", daemon=True)
        self._thread.start()

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._name

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    # ------------------------------------------------ queueing
    def _issue(self, kind: str, header: list, run: Callable[[dist.ProcessGroup], None], outputs: list) -> SimWork:
        """Queue ``run(inner)`` (blocking on the worker thread) behind every earlier collective of the group.
        ``header``: the ints every rank must agree on (sizes, dtype) for this to pair; None for point to point."""
        COUNTERS.issued[kind] += 1
        work = SimWork(kind, outputs)
        with self._lock:
            if self._aborted is not None:
                work._fail(self._aborted)
                return work
            self._pending.append(work)
        self._queue.put((work, header, run))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, header, run = item
            try:
                if self._aborted is None and not self._stuck and header is not None and not self._agree(header):
                    self._stuck = True
                if self._aborted is not None:
                    work._fail(self._aborted)
                elif self._stuck:
                    work._stick()
                else:
                    run(self._inner)
                    work._finish()
            except BaseException as e:  # noqa: BLE001 - the work carries the failure to whoever waits
                work._fail(self._aborted or e)
            with self._lock:
                if work._completed and work in self._pending:
                    self._pending.remove(work)

    def _agree(self, header: list) -> bool:
        # a fixed-size digest: gloo aborts the process on an all-gather whose sizes differ between ranks
        mine = torch.tensor([header[0], len(header), zlib.crc32(repr(header).encode())], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self._size)]
        self._inner.allgather([everyone], [mine]).wait()
        return all(torch.equal(e, mine) for e in everyone)

    def abort(self) -> None:
        """Fail every pending and later collective of this group (``ProcessGroupNCCL::abort``)."""
        COUNTERS.aborts += 1
        with self._lock:
            self._aborted = self._aborted or RuntimeError("nccl_sim: the process group was aborted")
            pending, self._pending = self._pending, []
        for w in pending:
            w._fail(self._aborted)

    def hang(self) -> None:
        """From now on no collective of this group completes, on this rank (call it on every rank for a network
        fault): their waits return, the host runs ahead over NaN, ``is_completed()`` stays False until abort."""
        self._stuck = True

    def shutdown(self) -> None:
        self._queue.put(None)

    # ------------------------------------------------ collectives (torch calls these by name)
    @staticmethod
    def _sig(kind: str, *tensors, extra: int = 0) -> list:
        sig = [_KINDS[kind], extra]
        for t in tensors:
            sig += [t.numel(), _dtype_code(t.dtype)]
        return sig

    def all_gather_single(self, out, inp, opts=None):
        def run(g):
            g.allgather([list(out.chunk(self._size))], [inp]).wait()
        return self._issue("all_gather", self._sig("all_gather", out, inp), run, [out])

    _allgather_base = all_gather_single     # torch < 2.12 names it so

    def allgather(self, outs, inps, opts=None):
        def run(g):
            g.allgather(outs, inps).wait()
        return self._issue("all_gather_list", self._sig("all_gather_list", *inps, extra=len(outs[0])), run,
                           [t for o in outs for t in o])

    def reduce_scatter_single(self, out, inp, opts=None):
        op = _op(opts)

        def run(g):
            full = inp.clone()
            _all_reduce(g, full, op, self._size)
            out.copy_(full.chunk(self._size)[self._rank].view_as(out))
        return self._issue("reduce_scatter", self._sig("reduce_scatter", out, inp, extra=int(op)), run, [out])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outs, inputs, opts=None):
        op = _op(opts)

        def run(g):
            for out, chunks in zip(outs, inputs):
                full = torch.cat([c.reshape(-1) for c in chunks])
                _all_reduce(g, full, op, self._size)
                out.copy_(full.chunk(self._size)[self._rank].view_as(out))
        return self._issue("reduce_scatter", self._sig("reduce_scatter", *outs, extra=int(op)), run, list(outs))

    def allreduce(self, tensors, opts=None):
        op = _op(opts)

        def run(g):
            for t in tensors:
                _all_reduce(g, t, op, self._size)
        return self._issue("all_reduce", self._sig("all_reduce", *tensors, extra=int(op)), run, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    # rooted collectives: torch hands the options (root rank) it built; gloo takes the same object
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._issue("broadcast", self._sig("broadcast", *tensors, extra=opts.rootRank),
                           lambda g: g.broadcast(tensors, opts).wait(), list(tensors))

    def barrier(self, opts=None):
        def run(g):
            g.allreduce([torch.zeros(1)]).wait()
        return self._issue("barrier", self._sig("barrier"), run, [])

    def gather(self, outs, inps, opts=None):
        opts = opts or dist.GatherOptions()
        return self._issue("gather", self._sig("gather", *inps, extra=opts.rootRank),
                           lambda g: g.gather(outs, inps, opts).wait(), [t for o in outs for t in o])

    def scatter(self, outs, inps, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._issue("scatter", self._sig("scatter", *outs, extra=opts.rootRank),
                           lambda g: g.scatter(outs, inps, opts).wait(), list(outs))

    def all_to_all_single(self, out, inp, out_splits, in_splits, opts=None):
        def run(g):
            g.alltoall_base(out, inp, list(out_splits or []), list(in_splits or []), dist.AllToAllOptions()).wait()
        # split sizes differ per rank by design: the header pairs the kind and dtype only
        return self._issue("all_to_all", [_KINDS["all_to_all"], _dtype_code(inp.dtype)], run, [out])

    alltoall_base = all_to_all_single

    def send(self, tensors, dst, tag=0):
        def run(g):
            g.send(tensors, dst, tag).wait()
        return self._issue("send", None, run, [])

    def recv(self, tensors, src, tag=0):
        def run(g):
            g.recv(tensors, src, tag).wait()
        return self._issue("recv", None, run, list(tensors))


def _op(opts):
    """The reduction as a ``RedOpType`` (options carry a ``ReduceOp`` object; its ``op`` is the type)."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
        raise NotImplementedError("nccl_sim: PREMUL_SUM is not simulated (gloo has none); scale, then SUM")
    return getattr(op, "op", op)


def _all_reduce(g, t: torch.Tensor, op, n: int) -> None:
    """``t`` reduced in place over ``g``; AVG as NCCL has it (gloo has no AVG: a sum, then a division)."""
    avg = op == dist.ReduceOp.AVG
    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.SUM if avg else op
    g.allreduce([t], o).wait()
    if avg:
        t.div_(n)


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number for the same dtype on every rank (``hash`` of a string differs between processes)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def _create(opts, _pg_options) -> SimGroup:
    group = SimGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    group._name = opts.group_id      # torch reads a group's name from its C++ backend, which a Python group lacks
    return group


_REGISTERED = []


def register() -> None:
    """Make ``init_process_group("nccl_sim")`` and ``new_group(backend="nccl_sim")`` available (idempotent)."""
    if not _REGISTERED:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        _REGISTERED.append(BACKEND)
