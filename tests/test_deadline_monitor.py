"""Issue 48: deadlines without host waits. On every backend but gloo ``collectives.wait`` calls the plain
``work.wait()`` and hands the deadline to a monitor thread (``_comm/deadlines.py``), which polls completion, names
the late rank from the store, aborts the stuck group and makes the training thread raise at its next engine entry.
"""
import time
from datetime import timedelta

import pytest

from _dist import run_ranks

import fsdp_plugin as fp
from fsdp_plugin._comm import collectives as comm, deadlines, status


@pytest.fixture(autouse=True)
def _no_failure_left_behind(monkeypatch):
    """A deadline error marks the process failed (``collectives.FAILED``: fp.shutdown then leaves the groups
    alone); these in-process tests must not leave that mark for the tests after them in the same worker."""
    monkeypatch.setattr(comm, "FAILED", False)


class RecordingWork:
    """A torch Work stand-in: records how it was waited; completes when told."""

    def __init__(self, done=False):
        self.done, self.waits = done, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True

    def is_completed(self):
        return self.done


def _tracked(backend, work, t_issue=None):
    op = status._Op(1, "0", "all_gather", 0, 16, backend=backend)
    if t_issue is not None:
        op.t_issue = t_issue
    return status._Tracked(work, op)


@pytest.mark.parametrize("backend", ["nccl", "nccl_sim", "ucc"])
def test_a_native_wait_passes_no_timeout_and_is_watched(backend, monkeypatch):
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monkeypatch.setattr(comm, "MONITOR", monitor)
    work = RecordingWork()
    fp.sync_stats.reset()
    comm.wait(_tracked(backend, work), "all-gather of unit 'x'", timeout_s=600)
    assert work.waits == [None]                     # wait(): a stream dependency, never wait(timeout=)
    assert monitor.watched == 1 and monitor.pending() == 1
    assert fp.sync_stats.timed == {} and fp.sync_stats.host == {}


def test_a_fake_wait_is_not_watched(monkeypatch):
    """torch's fake group: its works never report completion, though nothing is left to do: not watched."""
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monkeypatch.setattr(comm, "MONITOR", monitor)
    work = RecordingWork()
    comm.wait(_tracked("fake", work), "all-gather of unit 'x'", timeout_s=600)
    assert work.waits == [None] and monitor.watched == 0


def test_the_deadline_is_watched_before_the_wait(monkeypatch):
    """Finding 4: a wait that blocks the host (NCCL's barrier, TORCH_NCCL_BLOCKING_WAIT) still has the deadline:
    the monitor holds the collective before its plain wait is called."""
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monkeypatch.setattr(comm, "MONITOR", monitor)
    seen = []

    class Blocking(RecordingWork):
        def wait(self, timeout=None):
            seen.append(monitor.pending())
            return super().wait(timeout)
    comm.wait(_tracked("nccl", Blocking()), "barrier", timeout_s=600)
    assert seen == [1]


def test_gloo_keeps_its_timed_wait(monkeypatch):
    """gloo's wait blocks the host anyway: it carries the deadline itself (behaviour as before)."""
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monkeypatch.setattr(comm, "MONITOR", monitor)
    work = RecordingWork()
    fp.sync_stats.reset()
    comm.wait(_tracked("gloo", work), "all-gather", timeout_s=600)
    assert work.waits == [timedelta(seconds=600)] and monitor.watched == 0
    assert fp.sync_stats.timed == {"gloo": 1}


def test_a_host_read_polls_instead_of_a_timed_wait(monkeypatch):
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monkeypatch.setattr(comm, "MONITOR", monitor)
    work = RecordingWork(done=True)
    fp.sync_stats.reset()
    comm.wait(_tracked("nccl", work), "checkpoint metadata", timeout_s=600, host=True)
    assert work.waits == [None] and fp.sync_stats.host == {"nccl": 1} and fp.sync_stats.timed == {}


def test_the_monitor_retires_completed_work_and_fails_one_past_its_deadline():
    aborted, retired = [], []
    monitor = deadlines.Monitor(comm._collective_error, aborted.append)
    wall, now = time.time(), time.monotonic()
    done, stuck, later = RecordingWork(True), RecordingWork(), RecordingWork()
    monitor._thread = object()            # drive poll() by hand: no thread
    monitor.watch(done, _tracked("nccl", done, wall - 100).fp_op, "first", 10, "0", on_retire=retired.append)
    monitor.watch(stuck, _tracked("nccl", stuck, wall - 5).fp_op, "all-gather of unit 'blocks.1'", 10, "3")
    monitor.watch(later, _tracked("nccl", later, wall).fp_op, "third", 10, "0")
    monitor.poll(now)
    assert monitor.pending() == 2 and monitor.error is None and not aborted    # 'first' retired, 'stuck' in time
    assert len(retired) == 1
    monitor.check()
    monitor.poll(now + 6)                 # 11 s after the stuck one's issue: past its 10 s
    assert aborted == ["3"] and monitor.pending() == 0
    with pytest.raises(fp.CollectiveError, match=r"all-gather of unit 'blocks.1'.*did not complete within 10s"):
        monitor.check()
    with pytest.raises(fp.CollectiveError):         # every later engine entry raises the same
        monitor.watch(RecordingWork(), None, "next", 10)


def test_an_expired_collective_behind_a_longer_deadline_still_fails():
    """Finding 11: the queue is scanned whole; a checkpoint gather with an hour's deadline at its head must not
    hide a unit collective that expired behind it."""
    aborted = []
    monitor = deadlines.Monitor(comm._collective_error, aborted.append)
    monitor._thread = object()
    wall, now = time.time(), time.monotonic()
    monitor.watch(RecordingWork(), _tracked("nccl", None, wall).fp_op, "checkpoint gather", 3600, "0")
    monitor.watch(RecordingWork(), _tracked("nccl", None, wall).fp_op, "reduce-scatter of unit 'b'", 10, "2")
    monitor.poll(now + 11)
    assert aborted == ["2"]
    with pytest.raises(fp.CollectiveError, match="reduce-scatter of unit 'b'"):
        monitor.check()


def test_stop_ends_the_thread_and_forgets_the_queue():
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monitor.watch(RecordingWork(), None, "x", 600)
    thread = monitor._thread
    monitor.stop()
    assert monitor.pending() == 0 and monitor._thread is None and not thread.is_alive()


def test_a_failed_work_fails_at_once():
    class Broken(RecordingWork):
        def is_completed(self):
            raise RuntimeError("NCCL communicator was aborted on rank 1")
    monitor = deadlines.Monitor(comm._collective_error, lambda name: None)
    monitor._thread = object()
    monitor.watch(Broken(), None, "reduce-scatter", 600)
    monitor.poll()
    with pytest.raises(fp.CollectiveError, match="reduce-scatter failed.*aborted on rank 1"):
        monitor.check()


def _late_peer(rank, world):
    """Rank 0 'issues' a collective rank 1 never joins; the monitor thread names rank 1 as late."""
    import torch.distributed as dist
    comm.FAILED = False
    status.publishing()
    dist.barrier()
    if rank == 1:
        time.sleep(6)
        return None
    work = status.issued(RecordingWork(), "all_gather", None, world, 16)
    work.fp_op.backend = "nccl"           # as on a GPU: the wait takes the monitor's path
    aborted = []
    comm.MONITOR._abort = aborted.append
    t0 = time.time()
    comm.wait(work, "all-gather of unit 'blocks.0'", timeout_s=1.5)     # returns at once: stream order only
    returned = time.time() - t0
    while True:
        try:
            comm.MONITOR.check()
        except fp.CollectiveError as e:
            return returned, time.time() - t0, str(e), aborted
        time.sleep(0.05)


def test_a_late_rank_is_named_by_the_monitor_on_the_training_thread():
    returned, raised_after, message, aborted = run_ranks(_late_peer, 2, timeout=60)[0]
    assert returned < 0.5
    assert 1.4 < raised_after < 4.0, raised_after
    assert "did not complete within 2s" in message or "did not complete within 1s" in message, message
    assert "rank 1" in message and "Not arrived" in message, message
    assert len(aborted) == 1


def test_the_group_is_aborted_even_when_the_report_fails():
    """Finding 11: building the error reads the rendezvous store; if that raises, the stuck group is still
    aborted (a training thread blocked in it must be released) and the failure is still raised."""
    aborted = []

    def broken_report(*args):
        raise OSError("store host unreachable")
    monitor = deadlines.Monitor(broken_report, aborted.append)
    monitor._thread = object()
    monitor.watch(RecordingWork(), _tracked("nccl", None, time.time()).fp_op, "all-gather", 1, "5")
    monitor.poll(time.monotonic() + 2)
    assert aborted == ["5"] and monitor.pending() == 0
    with pytest.raises(OSError, match="store host unreachable"):
        monitor.check()


def test_on_cuda_the_monitor_polls_an_event_and_keeps_no_work(monkeypatch):
    """Findings 1 and 11: after the plain wait the handle trades the work (which holds the collective's output
    buffers: NCCL's Work keeps them) for an event recorded on the current stream, and polls that; any work type
    (a quantized ``_Then`` wrapping a tracked torch Work) is unwrapped the same way."""
    import torch

    class Event:
        recorded = 0

        def record(self):
            Event.recorded += 1

        def query(self):
            return True
    monkeypatch.setattr(torch.cuda, "Event", Event)

    class Then:                       # the shape of quantized._Then: a wrapper around a tracked work
        def __init__(self, work):
            self.work = work
    inner = RecordingWork()
    handle = deadlines.Handle(Then(_tracked("nccl", inner)))
    assert handle.work is inner and not handle.done()
    handle.after_wait(torch.device("cuda", 0))
    assert handle.work is None and Event.recorded == 1 and handle.done()
    cpu = deadlines.Handle(RecordingWork(done=True))
    cpu.after_wait(torch.device("cpu"))
    assert cpu.work is not None and cpu.done()
