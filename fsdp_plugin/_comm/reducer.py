"""The reduction thread: finishes two-rank tagged all-reduces (``collectives._P2PAllReduce``) off the host's
critical path.

gloo's native all-reduce sums in its own worker thread while the caller computes; the tagged point-to-point
all-reduce (the pairing check's form for no_shard and hybrid's two replicas on gloo/CPU) used to sum when the
handle waited, on the training thread: the whole tensor, at every unit (RESULTS § 30c). Here one daemon thread
per process waits each job's receive and send (in issue order: a job waits only on its own messages, so FIFO
cannot deadlock) and adds the peer's tensor into this rank's; the training thread's ``wait`` then only waits
for the job's event. The arithmetic and its order are unchanged (one commutative addition: the same bits on
both ranks). torch releases the GIL in ``Work.wait`` and in the add's kernel, so the thread runs beside
compute.

Failures keep their meaning: a peer that died raises in the thread's wait and is re-raised by the training
thread's (``RuntimeError``, which ``collectives.wait`` turns into a ``CollectiveError``); a divergence's
complement (``tagged``) completes the receive and the thread then skips the add (``tagged.diverged``); the
training thread's deadline is its own wait on the event. A forked child starts its own thread.
"""
from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import Callable, Optional

_queue: "Optional[queue.SimpleQueue]" = None
_owner_pid: Optional[int] = None


class Job:
    """A reduction handed to the thread: wait ``works``, then ``finish()``; waited like a torch Work."""

    __slots__ = ("works", "finish", "event", "error")

    def __init__(self, works: list, finish: Callable[[], None]):
        self.works, self.finish = works, finish
        self.event = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self.event.wait(timeout.total_seconds() if timeout is not None else None):
            raise RuntimeError(f"timed out after {timeout.total_seconds():.0f}s waiting for a reduction")
        if self.error is not None:
            raise self.error
        return True


def submit(works: list, finish: Callable[[], None]) -> Job:
    """Queue ``works`` (already posted) and ``finish`` (run once they completed) on the thread."""
    job = Job(works, finish)
    _thread_queue().put(job)
    return job


def _thread_queue() -> "queue.SimpleQueue":
    global _queue, _owner_pid
    if _queue is None or _owner_pid != os.getpid():
        _queue, _owner_pid = queue.SimpleQueue(), os.getpid()
        threading.Thread(target=_run, args=(_queue,), name="fsdp_plugin-reducer", daemon=True).start()
    return _queue


def _run(q: "queue.SimpleQueue") -> None:
    while True:
        job = q.get()
        try:
            for w in job.works:
                w.wait()
            job.finish()
        except BaseException as e:      # re-raised by the training thread's wait
            job.error = e
        finally:
            job.works = None
            job.event.set()
