"""Side streams for a unit's collectives on CUDA (issue 48): the all-gather's copy-in and issue, the reduction's cast
and issue, off the compute stream, ordered by stream waits — never by a host sync, never by ``record_stream``.

``gather``: ``unshard`` casts the master shard into the compute dtype and issues the all-gather here, after this
stream waits on the compute stream (``wait_stream``: a device-side dependency recorded where the host is, i.e.
before the compute the prefetch should hide behind). NCCL's own stream waits on this one at issue, so unit k+1's
gather depends only on its copy-in and overlaps unit k's compute; ``wait_unshard``'s plain ``work.wait()`` makes
the compute stream wait on it. ``reduce``: ``start_reduce`` casts the gradient on the CURRENT stream (as FSDP2's
``foreach_reduce``), then allocates the output and issues the reduce-scatter (or no_shard's all-reduce) here,
overlapping the rest of backward; ``finish_reduce``'s wait orders the compute stream after it.

Why freed memory stays safe without ``record_stream`` (the caching allocator hands a freed block to the next
allocation on the stream it was allocated on, with no other ordering):
(a) a block allocated on the compute stream and read or written by a side stream or NCCL's (the unsharded
``_full`` buffer, the reduction's cast input, hpZ's held slice) is released by the host only after the compute
stream waited on that collective (``wait_unshard``, `_PendingReduce.wait`); a gradient block backward wrote is
read only on the compute stream (the cast), never on a side stream;
(b) a block allocated on a side stream (the cast shard, the reduction's output) is reused by that side stream only
after its next ``wait_stream(compute)``, which comes after every compute-stream use the host queued before.
Memory in flight is bounded by the schedule — the prefetch depth for gathers, one pending reduction
(``_reduce/reduction.py``) — with no host sync. ``tests/test_streams.py`` checks (a) and (b) with a model of the
allocator's per-stream pools.

CPU tensors (gloo, and every test here) take no stream: ``for_device`` returns None and the code path is the one
it always was. The protocol is unit-tested with a fake stream module (``tests/test_streams.py``).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

_CACHE: dict = {}


class CommStreams:
    """The side streams of one device. ``backend``: ``torch.cuda`` (a fake module in tests) with ``Stream``,
    ``current_stream`` and ``stream``."""

    def __init__(self, device: torch.device, backend=None):
        self.device = device
        self.backend = backend if backend is not None else torch.cuda
        # high priority, as FSDP2's: a copy-in or cast is never queued behind a long compute kernel
        self.gather = self.backend.Stream(device=device, priority=-1)
        self.reduce = self.backend.Stream(device=device, priority=-1)

    @contextlib.contextmanager
    def on(self, stream):
        """Run the body on ``stream`` after it waited on the compute stream (its current position)."""
        stream.wait_stream(self.backend.current_stream(self.device))
        with self.backend.stream(stream):
            yield


def for_device(device: torch.device) -> Optional[CommStreams]:
    """The side streams of ``device`` (created once per device), or None off CUDA."""
    if device.type != "cuda":
        return None
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _CACHE:
        _CACHE[key] = CommStreams(torch.device("cuda", key[1]))
    return _CACHE[key]


def on(streams: Optional[CommStreams], which: str):
    """``streams.on(streams.<which>)``, or nothing to do without side streams."""
    return streams.on(getattr(streams, which)) if streams is not None else contextlib.nullcontext()
