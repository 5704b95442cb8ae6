"""Fork-based multi-rank harness for engine tests.

``run_ranks(fn, world_size, *args)`` forks one process per rank, rendezvous through a FileStore,
initializes a gloo process group (``nccl_sim`` under ``FSDP_TEST_BACKEND=nccl_sim``), runs ``fn(rank, world_size, *args)`` and returns the list of return
values (they must be picklable: this is test-only plumbing, never a load path). The first rank that
fails or the deadline kills every rank and raises ``RankFailure`` with the failing rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


class RankFailure(AssertionError):
    pass


class _WireTensor:
    """Tensors cross the queue as bytes: torch's shared-memory reduction can hang when a rank exits."""

    def __init__(self, t: torch.Tensor):
        t = t.detach().cpu().contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""

    def restore(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.shape)


def _to_wire(x):
    from torch.utils._pytree import tree_map
    return tree_map(lambda v: _WireTensor(v) if isinstance(v, torch.Tensor) else v, x)


def _from_wire(x):
    from torch.utils._pytree import tree_map
    return tree_map(lambda v: v.restore() if isinstance(v, _WireTensor) else v, x)


BACKEND_ENV = "FSDP_TEST_BACKEND"


def backend() -> str:
    """The ranks' backend: gloo, or ``nccl_sim`` (NCCL's completion semantics on CPU: ``fsdp_plugin.testing``) when
    ``FSDP_TEST_BACKEND=nccl_sim`` (.ci/run's nccl_sim lane runs the parity, quantized, deadline and checkpoint
    suites so)."""
    name = os.environ.get(BACKEND_ENV, "gloo")
    if name == "nccl_sim":
        import fsdp_plugin.testing  # noqa: F401 - registers the backend
    return name


def _worker(rank, world_size, store_path, fn, args, env, queue):
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend(), store=store, rank=rank, world_size=world_size)
        assert dist.get_backend() == backend()     # a lane that silently ran gloo would prove nothing
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # fn may have ended it with fp.shutdown()
                dist.destroy_process_group()
        queue.put((rank, True, _to_wire(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()


def _collect_failures(queue, rank, payload, grace: float = 1.0) -> str:
    """The first failure often makes peers fail with transport errors; report the root cause first."""
    failures = [(rank, payload)]
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            r, ok, p = queue.get(timeout=max(end - time.monotonic(), 0.01))
        except Exception:  # queue.Empty
            break
        if not ok:
            failures.append((r, p))
    secondary = ("gloo/transport", "Connection reset", "Connection closed")
    failures.sort(key=lambda f: any(s in f[1] for s in secondary))
    return "\n".join(f"rank {r} failed:\n{p}" for r, p in failures)


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, env: dict | None = None, may_die=()):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; return results by rank.

    Ranks in ``may_die`` may exit without a result (fault-injection tests): their result is None."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        base_env = {"LOCAL_WORLD_SIZE": str(world_size), "WORLD_SIZE": str(world_size)}
        base_env.update(env or {})
        procs = []
        for rank in range(world_size):
            rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(target=_worker, args=(rank, world_size, store_path, fn, args, rank_env, queue))
            p.start()
            procs.append(p)
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankFailure(f"deadline of {timeout:.0f}s passed; ranks done: {sorted(results)}")
                try:
                    rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
                except Exception:  # queue.Empty
                    dead = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in results]
                    for i in [d for d in dead if d in may_die]:
                        results[i] = None
                    dead = [i for i in dead if i not in may_die and procs[i].exitcode != 0]
                    if dead:
                        raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                    continue
                if not ok:
                    raise RankFailure(_collect_failures(queue, rank, payload))
                results[rank] = _from_wire(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(timeout=5)
        return [results[r] for r in range(world_size)]
